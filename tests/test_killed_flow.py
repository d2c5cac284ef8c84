"""kill -9 of an embedded `needle finetune` mid-training, then the same command again: the
Prefect server it started is stopped, the next run marks the dead MLflow run KILLED and resumes
the fine-tune from its checkpoints instead of starting over."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from needle_flows.reaper import server_children

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


def _command(sample_data: dict[str, Path]) -> list[str]:
    params = {"base_data": str(sample_data["base"]), "base_steps": 4, "batch_size": 8, "max_len": 256,
              "train": {"log_every": 1, "checkpoint_every": 5},
              "eval": {"max_rows": 4, "batch_size": 4, "max_new_tokens": 8}}
    return [sys.executable, "-m", "needle_flows.cli", "finetune", str(sample_data["new"]), "--preset", "tiny",
            "--base", "auto", "--steps", "150", "--params", json.dumps(params)]


def _env(state: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PREFECT_API_URL", "PREFECT_HOME", "MLFLOW_TRACKING_URI") and not k.startswith("PREFECT__")}
    return {**env, "NEEDLE_STATE_DIR": str(state), "JAX_PLATFORMS": "cpu"}


def _checkpoints(state: Path) -> list[int]:
    found = state.glob("finetune/*/checkpoints/*/needle_checksums.json")
    return sorted(int(p.parent.name) for p in found if p.parent.name.isdigit())  # not orbax tmp dirs


def test_killed_embedded_flow_is_cleaned_up_and_resumed(sample_data: dict[str, Path], tmp_path: Path) -> None:
    import psutil
    from mlflow.tracking import MlflowClient

    state = tmp_path / "state"
    first = subprocess.Popen(_command(sample_data), cwd=ROOT, env=_env(state), stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    servers: list[Any] = []
    deadline = time.monotonic() + 600
    while not _checkpoints(state) or _checkpoints(state)[-1] < 10:
        assert first.poll() is None and time.monotonic() < deadline, "the first run ended before a checkpoint"
        servers = server_children(first.pid) or servers
        time.sleep(0.1)
    assert servers, "the embedded run's Prefect server was not seen"
    os.kill(first.pid, signal.SIGKILL)  # as the OOM killer would: the process alone
    first.wait()
    killed_at = _checkpoints(state)[-1]
    assert killed_at < 150
    gone, alive = psutil.wait_procs(servers, timeout=30)
    assert not alive, "the dead run's Prefect server is still up"

    second = subprocess.run(_command(sample_data), cwd=ROOT, env=_env(state), capture_output=True, text=True,
                            timeout=900)
    out = second.stdout + second.stderr
    assert second.returncode == 0, out[-3000:]
    assert "marked KILLED" in out
    resumed = [int(line.rsplit("at step ", 1)[1].split()[0]) for line in out.splitlines()
               if "resuming lora training at step" in line]
    assert resumed and resumed[0] >= killed_at

    client = MlflowClient(tracking_uri=f"sqlite:///{state / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("needle-local").experiment_id],
                              order_by=["attributes.start_time ASC"])
    assert [r.info.status for r in runs] == ["KILLED", "FINISHED"]
    assert "process" in runs[0].data.tags["failure_reason"]
