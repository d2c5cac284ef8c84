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
from train_worker import collect_losses

from needle.train.sharding import DATA_AXIS, make_mesh, replicate, shard_batch

WORKER = Path(__file__).with_name("train_worker.py")


def test_mesh_sharded_batch_and_replicated_tree() -> None:
    mesh = make_mesh()
    assert mesh.axis_names == (DATA_AXIS,) and mesh.size >= 1
    batch = shard_batch({"inputs": np.arange(8 * 4, dtype=np.int32).reshape(8, 4)}, mesh)
    assert batch["inputs"].sharding.spec == PartitionSpec(DATA_AXIS)
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
