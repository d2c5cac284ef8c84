"""run_training as one program over two ``jax.distributed`` processes: a kill -9 of one fails the
other within a bounded time, and the rerun resumes from the shared checkpoints to the model of an
uninterrupted one-process run, on two processes or on one; process 1 reports nothing."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_run import assert_same_params, flat_params
from train_helpers import scratch_reference

from needle.train.distributed import free_port
from needle.train.run import run_training

WORKER = Path(__file__).with_name("train_worker.py")
pytestmark = pytest.mark.slow


def _start(args: list[str], log_dir: Path, tag: str) -> list[subprocess.Popen]:
    """Both processes of a group (one CPU device each, fsdp=2), output to ``log_dir/<tag><rank>``."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"JAX_PLATFORMS": "cpu"}
    coordinator = f"127.0.0.1:{free_port()}"
    return [
        subprocess.Popen([sys.executable, str(WORKER), "finetune", *args, coordinator, "2", str(rank), "2"], env=env,
                         stdout=open(log_dir / f"{tag}{rank}", "w"), stderr=subprocess.STDOUT)  # fmt: skip
        for rank in (0, 1)
    ]


def _steps(log: Path) -> list[int]:
    return [int(line.split()[1]) for line in log.read_text().splitlines() if line.startswith("step ")]


def test_killed_process_fails_the_group_and_the_rerun_resumes(tmp_path: Path) -> None:
    steps = 8
    prepared, tok, data_dir, tok_dir, configs, reference = scratch_reference(tmp_path, steps)

    out = tmp_path / "group"
    args = [str(data_dir), str(tok_dir), str(out), str(steps)]
    first = _start([*args, "1.0"], tmp_path, "first")
    deadline = time.monotonic() + 600
    while not (out / "checkpoints" / "2" / "needle_checksums.json").exists():
        assert all(p.poll() is None for p in first), (tmp_path / "first0").read_text()[-3000:]
        assert time.monotonic() < deadline, "the group never saved a checkpoint"
        time.sleep(0.05)
    os.kill(first[1].pid, signal.SIGKILL)
    killed_at = time.monotonic()
    first[0].wait(timeout=60)  # the survivor ends, it does not hang
    assert time.monotonic() - killed_at < 60 and first[0].returncode != 0
    assert not (out / "model").exists()
    # A copy resumes on one process: the checkpoint restores into another layout and process count.
    shutil.copytree(out, tmp_path / "one")
    single = run_training(prepared, tok, *configs, out_dir=tmp_path / "one")
    assert single.history[0]["step"] > 2  # resumed
    assert_same_params(flat_params(Path(reference.model_dir)), flat_params(Path(single.model_dir)), atol=1e-5)

    second = _start([*args, "0"], tmp_path, "second")
    for proc in second:
        assert proc.wait(timeout=600) == 0, (tmp_path / f"second{second.index(proc)}").read_text()[-3000:]
    resumed = _steps(tmp_path / "second0")
    assert resumed and resumed[0] > 2 and resumed[-1] == steps  # it resumed, it did not start over
    assert _steps(tmp_path / "second1") == [] and _steps(tmp_path / "first1") == []  # only process 0 reports
    assert_same_params(flat_params(Path(reference.model_dir)), flat_params(out / "model"), atol=1e-5)
