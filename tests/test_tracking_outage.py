"""Tracking outages against a real `mlflow server` on 127.0.0.1: training never waits on MLflow.

The server is killed while a tiny fine-tune runs: training and checkpoints go on, the metrics
are kept and reach MLflow once a server is back on the same store; a server that never comes
back leaves them in a spill file that the next run uploads; a closed port fails in seconds.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import requests

from needle.tracking.mlflow_tracker import (
    HEARTBEAT_TAG, MlflowTracker, TrackingUnavailableError, check_tracking, upload_pending_metrics,
)
from tests.train.train_helpers import finetune_configs, tiny_prepared, tiny_tokenizer

BIN = Path(sys.executable).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MlflowServer:
    """`mlflow server` in its own process group over one SQLite store; stop and start at will."""

    def __init__(self, root: Path) -> None:
        self.root, self.port = root, _free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        cmd = [str(BIN / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1",
               "--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}",
               "--artifacts-destination", str(self.root / "artifacts")]
        self.proc = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                if requests.get(f"{self.uri}/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                time.sleep(0.3)
        raise RuntimeError("mlflow server did not start")

    def kill(self) -> None:
        if self.proc is not None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            self.proc = None


@pytest.fixture()
def server(tmp_path: Path) -> Iterator[MlflowServer]:
    srv = MlflowServer(tmp_path / "mlflow")
    srv.start()
    try:
        yield srv
    finally:
        srv.kill()


def _new_run(uri: str) -> str:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    return client.create_run(client.create_experiment("outage")).info.run_id


class KillAtStep:
    """Forwards to a tracker; kills the server when step ``at`` is logged and times every call."""

    def __init__(self, inner: MlflowTracker, server: MlflowServer, at: int) -> None:
        self.inner, self.server, self.at = inner, server, at
        self.call_seconds: list[float] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if step >= self.at and self.server.proc is not None:
            self.server.kill()
        start = time.monotonic()
        self.inner.log_metrics(metrics, step)
        self.call_seconds.append(time.monotonic() - start)


@pytest.mark.slow
def test_server_killed_mid_training_then_back(server: MlflowServer, tmp_path: Path) -> None:
    from needle.train.run import run_training

    run_id = _new_run(server.uri)
    inner = MlflowTracker(run_id, server.uri, flush_every=1, flush_seconds=0.2, finish_timeout=180,
                          spill_dir=tmp_path / "pending", heartbeat_seconds=0)
    tracker = KillAtStep(inner, server, at=3)
    model_cfg, train, optim = finetune_configs("scratch", steps=8)
    result = run_training(tiny_prepared(), tiny_tokenizer(), model_cfg, train, optim, out_dir=tmp_path / "run",
                          tracker=tracker)
    # Training and checkpoints went on without the server.
    assert server.proc is None and result.final_step == 8
    assert (tmp_path / "run" / "checkpoints" / "8").is_dir() and (tmp_path / "run" / "model").is_dir()
    assert inner.pending > 0
    assert max(tracker.call_seconds) < 5.0  # MLflow's own retries take minutes per call
    server.start()  # back on the same port and store
    inner.finish()
    history = inner.client.get_metric_history(run_id, "loss")
    assert sorted(m.step for m in history) == list(range(1, 9))
    assert not (tmp_path / "pending").exists()
    assert inner.client.get_run(run_id).data.tags[HEARTBEAT_TAG].isdigit()


@pytest.mark.slow
def test_outage_until_the_end_spills_then_next_run_uploads(server: MlflowServer, tmp_path: Path) -> None:
    run_id = _new_run(server.uri)
    tracker = MlflowTracker(run_id, server.uri, flush_every=1000, flush_seconds=1e9, finish_timeout=3,
                            spill_dir=tmp_path / "pending", terminate_on_finish=False)
    server.kill()
    for step in range(1, 6):
        tracker.log_metrics({"loss": 1.0 / step}, step=step)
    started = time.monotonic()
    tracker.finish()
    assert time.monotonic() - started < 30
    spilled = tmp_path / "pending" / f"{run_id}.jsonl"
    assert len(spilled.read_text().splitlines()) == 5
    server.start()
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=server.uri)
    assert upload_pending_metrics(client, tmp_path / "pending") == {run_id: 5}
    assert sorted(m.step for m in client.get_metric_history(run_id, "loss")) == [1, 2, 3, 4, 5]
    assert not spilled.exists()


def test_closed_port_fails_in_seconds_with_the_password_redacted() -> None:
    uri = f"http://alice:s3cret@127.0.0.1:{_free_port()}"
    started = time.monotonic()
    with pytest.raises(TrackingUnavailableError) as info:
        check_tracking(uri)
    assert time.monotonic() - started < 10
    assert "s3cret" not in str(info.value) and "alice:***@127.0.0.1" in str(info.value)


def test_full_buffer_spills_oldest_and_keeps_the_newest(tmp_path: Path) -> None:
    uri = f"http://127.0.0.1:{_free_port()}"  # nothing listens: every delivery fails
    tracker = MlflowTracker("r" * 32, uri, flush_every=10_000, flush_seconds=1e9, max_buffer=3,
                            spill_dir=tmp_path, finish_timeout=0.5, terminate_on_finish=False)
    for step in range(5):
        tracker.log_metrics({"loss": float(step)}, step=step)
    assert tracker.pending == 3
    lines = (tmp_path / f"{'r' * 32}.jsonl").read_text().splitlines()
    assert [int(line.split('"step": ')[1].rstrip("}")) for line in lines] == [0, 1]
    tracker.finish()
    assert len((tmp_path / f"{'r' * 32}.jsonl").read_text().splitlines()) == 5


@pytest.mark.slow
def test_flow_trains_through_an_outage(server: MlflowServer, sample_data: dict[str, Path], tmp_path: Path) -> None:
    """The embedded flow with MLflow killed mid fine-tune and back later: exit 0, every step's loss."""
    import json

    from mlflow.tracking import MlflowClient

    from tests.test_killed_flow import _checkpoints, _command, _env

    state = tmp_path / "state"
    env = {**_env(state), "MLFLOW_TRACKING_URI": server.uri}
    proc = subprocess.Popen(_command(sample_data), cwd=Path(__file__).resolve().parents[1], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def wait_for_checkpoint(step: int) -> None:
        deadline = time.monotonic() + 600
        while not _checkpoints(state) or _checkpoints(state)[-1] < step:
            assert proc.poll() is None and time.monotonic() < deadline, "the run ended early"
            time.sleep(0.1)

    wait_for_checkpoint(10)
    server.kill()
    wait_for_checkpoint(40)  # training and checkpoints go on without MLflow
    server.start()
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out[-3000:]
    assert "is unreachable" in out and "is back after" in out
    client = MlflowClient(tracking_uri=server.uri)
    run = client.search_runs([client.get_experiment_by_name("needle-local").experiment_id])[0]
    assert run.info.status == "FINISHED"
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "loss")) == list(range(1, 151))
    assert json.loads(json.dumps(run.data.metrics))["tuned_exact_match"] >= 0.0
