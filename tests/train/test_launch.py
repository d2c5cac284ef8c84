"""One fine-tune on two Ray workers (a local Ray on 127.0.0.1, started and stopped by the call):
the same model as one process; a worker killed mid-run fails the run within a bounded time, and
the same call again resumes from the checkpoints to the uninterrupted run's model."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from test_run import assert_same_params, flat_params
from train_helpers import finetune_configs, tiny_prepared, tiny_tokenizer

from needle.config import ClusterConfig
from needle.data.prepare import save_cached
from needle.train.run import run_training
from needle.train.launch import TrainSpec, WorkerFailedError, train_on_workers

pytest.importorskip("ray")
pytestmark = [pytest.mark.slow, pytest.mark.own_process]  # a Ray driver: conftest.py


def _spec(tmp_path: Path, steps: int, out: str, **train: Any) -> tuple[TrainSpec, Any]:
    prepared, tok = tiny_prepared(), tiny_tokenizer()
    directory = tmp_path / "prepared"
    if not directory.exists():
        save_cached(prepared, tok, directory)
    model_cfg, train_cfg, optim = finetune_configs("scratch", steps=steps, **train)
    spec = TrainSpec(str(directory), model_cfg, train_cfg, optim, None, None, str(tmp_path / out))
    one = train_cfg.model_copy(update={"fsdp": 1})  # the same run in this process, on one device
    reference = run_training(prepared, tok, model_cfg, one, optim, out_dir=tmp_path / f"{out}-reference")
    return spec, reference


def test_two_ray_workers_train_the_one_process_model(tmp_path: Path) -> None:
    spec, reference = _spec(tmp_path, 6, "two", fsdp=2)
    result = train_on_workers(spec, ClusterConfig(workers=2))
    assert result.params["devices"] == 2 and [r["step"] for r in result.history] == list(range(1, 7))
    assert_same_params(flat_params(Path(reference.model_dir)), flat_params(Path(result.model_dir)), atol=1e-5)


def _ray_workers() -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if "ray::_Worker" in cmdline:
            found.append(proc)
    return found


def test_a_killed_worker_fails_the_run_and_the_rerun_resumes(tmp_path: Path) -> None:
    steps = 80  # checkpoints every 2 steps: the kill lands long before the end
    spec, reference = _spec(tmp_path, steps, "killed", keep_checkpoints=2)
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["result"] = train_on_workers(spec, ClusterConfig(workers=2))
        except BaseException as err:  # noqa: BLE001 - the test inspects it
            outcome["error"] = err

    thread = threading.Thread(target=run)
    thread.start()
    checkpoints, deadline = Path(spec.out_dir) / "checkpoints", time.monotonic() + 300
    while not (checkpoints.is_dir() and any(p.name.isdigit() for p in checkpoints.iterdir())):
        assert thread.is_alive() and time.monotonic() < deadline, outcome
        time.sleep(0.05)
    workers = _ray_workers()
    assert len(workers) == 2, workers
    workers[1].kill()
    killed_at = time.monotonic()
    thread.join(timeout=120)
    assert not thread.is_alive() and time.monotonic() - killed_at < 60
    error = outcome.get("error")
    assert isinstance(error, WorkerFailedError), outcome
    assert "of 2 failed" in str(error) and "run again to resume" in str(error)
    assert not (Path(spec.out_dir) / "model").exists()

    result = train_on_workers(spec, ClusterConfig(workers=2))
    assert result.history[0]["step"] > 2 and result.history[-1]["step"] == steps  # resumed
    assert_same_params(flat_params(Path(reference.model_dir)), flat_params(Path(result.model_dir)), atol=1e-5)
