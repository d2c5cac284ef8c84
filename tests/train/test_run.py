"""run_training end to end: scratch then LoRA, export, resume, refusal, and SIGKILL recovery."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from test_checkpoint import _data_files, _flip_bytes
from train_helpers import LORA, finetune_configs, scratch_reference, tiny_prepared, tiny_tokenizer

from needle.config import OptimConfig
from needle.errors import CheckpointMismatchError, NonFiniteLossError
from needle.model.io import load_model
from needle.tracking.tracker import MemoryTracker as RecordingTracker
from needle.train.run import run_training

WORKER = Path(__file__).with_name("train_worker.py")
pytestmark = pytest.mark.slow


def flat_params(model_dir: Path) -> dict[str, np.ndarray]:
    params = load_model(model_dir).params
    return {jax.tree_util.keystr(p): np.asarray(v) for p, v in jax.tree_util.tree_leaves_with_path(params)}


def assert_same_params(a: dict[str, np.ndarray], b: dict[str, np.ndarray], atol: float = 1e-6) -> None:
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_allclose(b[name], a[name], atol=atol, err_msg=name)


def test_scratch_then_lora_export_resume_and_refusal(tmp_path: Path) -> None:
    prepared, tok = tiny_prepared(), tiny_tokenizer()
    model_cfg, train, optim = finetune_configs("scratch", steps=4)
    tracker = RecordingTracker()
    base = run_training(prepared, tok, model_cfg, train, optim, out_dir=tmp_path / "base", tracker=tracker)
    assert base.final_step == 4 and base.model_dir == str(tmp_path / "base" / "model")
    assert [s for s, _ in tracker.metrics] == [1, 2, 3, 4]
    assert tracker.params["train.mode"] == "scratch" and tracker.params["data.fingerprint"] == "synthetic-0"
    assert base.val_loss is not None and np.isfinite(base.val_loss) and base.state is None
    assert sorted(p.name for p in (tmp_path / "base" / "checkpoints").iterdir() if p.name.isdigit()) == ["2", "4"]
    loaded = load_model(base.model_dir)
    assert loaded.model_cfg == model_cfg and loaded.meta["fingerprint"] == "synthetic-0"

    # A rerun finds the final checkpoint: no steps, the same export.
    again = run_training(prepared, tok, model_cfg, train, optim, out_dir=tmp_path / "base")
    assert again.history == [] and again.final_step == 4
    assert_same_params(flat_params(Path(base.model_dir)), flat_params(Path(again.model_dir)), atol=0)
    # How a step computes (loss chunks, micro-batches) is no part of what a resume must match.
    tweaked = train.model_copy(update={"micro_batch_tokens": 8, "loss_chunk": 7})
    assert run_training(prepared, tok, model_cfg, tweaked, optim, out_dir=tmp_path / "base").final_step == 4

    # LoRA on top: the export is in base layout (merged) and differs from the base.
    _, lora_train, lora_optim = finetune_configs("lora", steps=2)
    tuned = run_training(
        prepared, tok, model_cfg, lora_train, lora_optim, LORA, base_model_dir=base.model_dir, out_dir=tmp_path / "lora"
    )
    base_p, tuned_p = flat_params(Path(base.model_dir)), flat_params(Path(tuned.model_dir))
    assert base_p.keys() == tuned_p.keys() and not any("lora" in k for k in tuned_p)
    assert any(not np.allclose(base_p[k], tuned_p[k]) for k in base_p)
    # Embeddings and norms have no adapters: merging leaves them exactly as in the base.
    assert all(np.array_equal(base_p[k], tuned_p[k]) for k in base_p if "embed" in k or "scale" in k)

    # Another weight decay in the same out_dir would not be an exact resume: refused.
    with pytest.raises(CheckpointMismatchError, match="optim.weight_decay"):
        run_training(
            prepared, tok, model_cfg, lora_train, OptimConfig(lr=1e-2, warmup_steps=0, weight_decay=0.5), LORA,
            base_model_dir=base.model_dir, out_dir=tmp_path / "lora",
        )  # fmt: skip


def test_resume_after_sigkill_between_saves_matches_the_uninterrupted_run(tmp_path: Path) -> None:
    steps = 8
    _, _, data_dir, tok_dir, _, reference = scratch_reference(tmp_path, steps)

    out = tmp_path / "killed"
    cmd = [sys.executable, str(WORKER), "finetune", str(data_dir), str(tok_dir), str(out), str(steps)]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    child = subprocess.Popen([*cmd, "0.5"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 600
    ckpt_dir = out / "checkpoints"
    while not (ckpt_dir.is_dir() and any(p.name.isdigit() for p in ckpt_dir.iterdir())):
        assert child.poll() is None, child.stdout.read()[-3000:]
        assert time.monotonic() < deadline, "the child never saved a checkpoint"
        time.sleep(0.05)
    os.kill(child.pid, signal.SIGKILL)
    child.wait(timeout=60)
    assert child.returncode == -signal.SIGKILL
    saved = sorted(int(p.name) for p in ckpt_dir.iterdir() if p.name.isdigit())
    assert saved and max(saved) < steps and not (out / "model").exists()

    resumed = subprocess.run([*cmd, "0"], env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    # The resumed child logged only the steps after its checkpoint.
    logged = [int(line.split()[1]) for line in resumed.stdout.splitlines() if line.startswith("step ")]
    assert logged and logged[0] == max(saved) + 1 and logged[-1] == steps
    assert_same_params(flat_params(Path(reference.model_dir)), flat_params(out / "model"))


def saved_steps(ckpt_dir: Path) -> list[int]:
    return sorted(int(p.name) for p in ckpt_dir.iterdir() if p.name.isdigit())


@pytest.mark.filterwarnings("ignore:Sharding info not provided")
@pytest.mark.parametrize("every", [3, 4])
def test_a_diverging_run_never_saves_a_nan_checkpoint(tmp_path: Path, every: int) -> None:
    # The case: the tiny preset at optim.lr 1e4 diverges. Here step 6 still has a finite
    # loss while its update makes every param NaN: with checkpoint_every 3 the loss-only check
    # used to save that state. The step is named and nothing from it on is saved.
    prepared, tok = tiny_prepared(), tiny_tokenizer()
    model_cfg, train, _ = finetune_configs("scratch", steps=16)
    train = train.model_copy(update={"checkpoint_every": every, "log_every": 100, "keep_checkpoints": 10})
    out = tmp_path / "run"
    with pytest.raises(NonFiniteLossError, match=r"diverged at step \d+") as err:
        run_training(prepared, tok, model_cfg, train, OptimConfig(lr=1e4, warmup_steps=0), out_dir=out)
    message = str(err.value)
    assert "last good checkpoint:" in message and "\n" not in message
    bad_step = int(message.split("diverged at step ")[1].split(":")[0])
    steps = saved_steps(out / "checkpoints")
    assert all(step < bad_step for step in steps)
    assert (f"step {steps[-1]} in" in message) if steps else ("none was written" in message)
    for step in steps:  # read back with orbax alone: every saved leaf is finite
        tree = ocp.PyTreeCheckpointer().restore(out / "checkpoints" / str(step) / "state")
        floats = [np.asarray(x) for x in jax.tree.leaves(tree) if np.issubdtype(np.asarray(x).dtype, np.floating)]
        assert floats and all(np.isfinite(x).all() for x in floats), step
    assert not (out / "model").exists()


def test_a_damaged_newest_checkpoint_resumes_from_the_previous_one_exactly(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    prepared, tok = tiny_prepared(), tiny_tokenizer()
    model_cfg, train, optim = finetune_configs("scratch", steps=6)
    out = tmp_path / "run"
    first = run_training(prepared, tok, model_cfg, train, optim, out_dir=out)
    reference = flat_params(Path(first.model_dir))
    assert saved_steps(out / "checkpoints") == [4, 6]
    _flip_bytes(_data_files(out / "checkpoints" / "6")[0])
    with caplog.at_level(logging.WARNING, logger="needle"):
        again = run_training(prepared, tok, model_cfg, train, optim, out_dir=out)
    warnings = [r.getMessage() for r in caplog.records if r.name.startswith("needle") and r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "step 6" in warnings[0] and "falling back to step 4" in warnings[0]
    assert [r["step"] for r in again.history] == [5, 6]
    assert saved_steps(out / "checkpoints") == [4, 6]  # step 6 written again, the damaged one set aside
    assert_same_params(reference, flat_params(Path(again.model_dir)), atol=0)
