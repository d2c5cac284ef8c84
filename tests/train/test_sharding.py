"""Data parallelism: mesh and batch layout, and 8 fake CPU devices giving the 1-device losses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from jax.sharding import PartitionSpec
from train_worker import collect_losses, flat_params, run_losses

from needle.train.distributed import free_port
from needle.train.sharding import DATA_AXIS, FSDP_AXIS, fsdp_spec, make_mesh, replicate, shard_batch

WORKER = Path(__file__).with_name("train_worker.py")


def test_mesh_sharded_batch_and_replicated_tree() -> None:
    mesh = make_mesh()
    assert mesh.axis_names == (DATA_AXIS, FSDP_AXIS) and mesh.shape[FSDP_AXIS] == 1 and mesh.size >= 1
    batch = shard_batch({"inputs": np.arange(8 * 4, dtype=np.int32).reshape(8, 4)}, mesh)
    assert batch["inputs"].sharding.spec == PartitionSpec((DATA_AXIS, FSDP_AXIS))
    np.testing.assert_array_equal(np.asarray(batch["inputs"]), np.arange(32).reshape(8, 4))
    tree = replicate({"w": np.ones((3, 3), np.float32)}, mesh)
    assert tree["w"].sharding.is_fully_replicated


def test_shard_batch_rejects_a_scalar_with_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"batch\['step'\].*device"):
        shard_batch({"step": np.int32(3)}, make_mesh())


@pytest.mark.slow
def test_eight_devices_give_the_one_device_losses(tmp_path: Path) -> None:
    steps, batch_size = 3, 8
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, str(WORKER), "losses", str(steps), str(batch_size)],
        env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    eight = json.loads(proc.stdout.strip().splitlines()[-1])
    assert eight["devices"] == 8
    assert "leading size 4" in eight["rejected"] and "8 devices" in eight["rejected"]
    one = collect_losses(steps, batch_size)
    assert len(one) == len(eight["losses"]) == steps
    np.testing.assert_allclose(eight["losses"], one, atol=1e-5)
    # The steps really trained: the losses are not all the same number.
    assert len(set(np.round(one, 6))) > 1


def test_fsdp_layout_and_mesh_errors() -> None:
    assert fsdp_spec((64, 256), 4) == PartitionSpec(None, FSDP_AXIS)  # the largest axis that divides
    assert fsdp_spec((256, 30), 4) == PartitionSpec(FSDP_AXIS, None)
    assert fsdp_spec((30, 50), 4) == PartitionSpec()  # nothing divides: replicated
    assert fsdp_spec((32,), 4) == PartitionSpec() and fsdp_spec((64, 256), 1) == PartitionSpec()  # small; one device
    n = make_mesh().size
    with pytest.raises(ValueError, match=f"fsdp={n + 1} does not divide the {n} devices"):
        make_mesh(fsdp=n + 1)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["full", "lora"])
def test_fsdp_over_four_devices_gives_the_one_device_training(mode: str, tmp_path: Path) -> None:
    """fsdp=4 on 4 virtual CPU devices: the same losses (1e-5) and final params as one device, with
    each device holding a quarter of every large frozen leaf (and, in full fine-tuning, trained leaf)."""
    steps, batch_size = 3, 8
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, str(WORKER), "fsdp", str(steps), str(batch_size), "4", mode],
                          env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    four = json.loads(proc.stdout.strip().splitlines()[-1])
    assert four["devices"] == 4
    one_losses, one_state = run_losses(steps, batch_size, 1, mode)
    np.testing.assert_allclose(four["losses"], one_losses, atol=1e-5)
    assert len(set(np.round(one_losses, 6))) > 1  # it trained
    sharded = np.load(tmp_path / "params.npz")
    one = flat_params(one_state)
    assert set(sharded.files) == set(one)
    for key, value in one.items():
        np.testing.assert_allclose(sharded[key], value, atol=1e-5, err_msg=key)
    shares = four["shares"]
    frozen = {k: v for k, v in shares.items() if k.startswith("['frozen']")}
    trained = {k: v for k, v in shares.items() if k.startswith("['trainable']")}
    if mode == "full":
        assert trained and all(v == 0.25 for v in trained.values()), trained
    else:
        assert frozen and all(v == 0.25 for v in frozen.values()), frozen
        assert all(v == 1.0 for v in trained.values()), trained  # adapters replicated


@pytest.mark.slow
@pytest.mark.parametrize("mode,fsdp", [("lora", 1), ("full", 2)])
def test_two_processes_give_the_one_process_training(mode: str, fsdp: int, tmp_path: Path) -> None:
    """Two ``jax.distributed`` processes of one CPU device each, joined over gloo, train one
    program: data-parallel LoRA, and full fine-tuning sharded over both (fsdp=2), give the losses
    (1e-5 per step) and final weights of one process with the same global batch."""
    steps, batch_size = 3, 8
    coordinator = f"127.0.0.1:{free_port()}"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"JAX_PLATFORMS": "cpu"}
    procs = [
        subprocess.Popen([sys.executable, str(WORKER), "group", coordinator, "2", str(rank), str(steps),
                          str(batch_size), str(fsdp), mode],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
        for rank in (0, 1)
    ]  # fmt: skip
    outs = [p.communicate(timeout=600) for p in procs]
    for proc, (_, err) in zip(procs, outs):
        assert proc.returncode == 0, err[-3000:]
    reports = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    assert [r["process"] for r in reports] == [0, 1] and all(r["devices"] == 2 for r in reports)
    one_losses, one_state = run_losses(steps, batch_size, 1, mode)
    for report in reports:
        np.testing.assert_allclose(report["losses"], one_losses, atol=1e-5)
    sharded, one = np.load(tmp_path / "params.npz"), flat_params(one_state)
    assert set(sharded.files) == set(one)
    for key, value in one.items():
        np.testing.assert_allclose(sharded[key], value, atol=1e-5, err_msg=key)
    # Full: process 1's device holds half of each large trained leaf; LoRA (fsdp=1): a whole base.
    prefix, share = ("['trainable']", 0.5) if mode == "full" else ("['frozen']", 1.0)
    shares = [v for k, v in reports[1]["shares"].items() if k.startswith(prefix)]
    assert shares and all(v == share for v in shares), reports[1]["shares"]
