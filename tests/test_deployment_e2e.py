"""End to end on loopback: the stack scripts start Prefect, MLflow and a worker in a temp dir,
prefect.yaml is deployed, and `prefect deployment run needle/finetune --watch` trains for real.
A good run is tracked and registered; a bad dataset fails with file:line, FAILED, no version."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """The running stack's environment; every process group is stopped afterwards."""
    root = tmp_path_factory.mktemp("stack")
    prefect_port, mlflow_port = _free_port(), _free_port()
    env = {
        **os.environ,
        "NEEDLE_STACK_DIR": str(root / "stack"),
        "NEEDLE_STATE_DIR": str(root / "state"),
        "NEEDLE_BIN": str(BIN),
        "PREFECT_PORT": str(prefect_port),
        "MLFLOW_PORT": str(mlflow_port),
        "JAX_PLATFORMS": "cpu",
        "PREFECT_WORKER_QUERY_SECONDS": "2",
        "STACK_TIMEOUT": "240",
        "PREFECT_HOME": str(root / "stack" / "prefect"),
        "PREFECT_API_URL": f"http://127.0.0.1:{prefect_port}/api",
        "MLFLOW_TRACKING_URI": f"http://127.0.0.1:{mlflow_port}",
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    try:
        up = subprocess.run([str(ROOT / "deployments" / "stack-up.sh")], env=env, capture_output=True, text=True, timeout=600)
        assert up.returncode == 0, up.stdout + up.stderr
        yield env
    finally:
        subprocess.run([str(ROOT / "deployments" / "stack-down.sh")], env=env, capture_output=True, timeout=120)


def _run_deployment(env: dict[str, str], params: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    cmd = ["prefect", "deployment", "run", "needle/finetune", "--watch", "--param", f"params={json.dumps(params)}"]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)


def _last_failed_message(env: dict[str, str]) -> str:
    """The state message of the newest failed flow run, read through the Prefect API."""
    script = (
        "import asyncio\n"
        "from prefect.client.orchestration import get_client\n"
        "from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterStateType\n"
        "from prefect.client.schemas.sorting import FlowRunSort\n"
        "async def main():\n"
        "    async with get_client() as c:\n"
        "        runs = await c.read_flow_runs(flow_run_filter=FlowRunFilter(state=dict(type=FlowRunFilterStateType(any_=['FAILED']))),\n"
        "                                      sort=FlowRunSort.START_TIME_DESC, limit=1)\n"
        "        print(runs[0].state.message)\n"
        "asyncio.run(main())\n"
    )
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    return out.stdout + out.stderr


def test_deployment_trains_tracks_registers_and_fails_cleanly(
    stack: dict[str, str], tiny_flow_params: dict[str, Any], bad_data: Path, bad_line: int
) -> None:
    from mlflow.tracking import MlflowClient

    good = _run_deployment(stack, tiny_flow_params)
    assert good.returncode == 0, good.stdout[-3000:] + good.stderr[-3000:]
    client = MlflowClient(tracking_uri=stack["MLFLOW_TRACKING_URI"])
    exp = client.get_experiment_by_name("needle/finetune")
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.status == "FINISHED"
    assert run.data.tags["backend"] == "cpu" and run.data.tags["prefect.deployment"] == "finetune"
    assert run.data.params["lora.rank"] == "16" and run.data.params["model.preset"] == "tiny"
    assert "optim.lr" in run.data.params
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "loss")) == [1, 2, 3, 4]
    assert "tuned_exact_match" in run.data.metrics and "base_valid_call_rate" in run.data.metrics
    versions = client.search_model_versions("name = 'needle'")
    assert [v.run_id for v in versions] == [run.info.run_id]

    bad = _run_deployment(stack, {**tiny_flow_params, "data": str(bad_data)})
    assert bad.returncode == 1, bad.stdout[-3000:]
    assert f"{bad_data.name}:{bad_line}:" in _last_failed_message(stack)
    (failed,) = client.search_runs([exp.experiment_id], "attributes.status = 'FAILED'")
    assert f"{bad_data.name}:{bad_line}:" in failed.data.tags["failure_reason"]
    assert len(client.search_model_versions("name = 'needle'")) == 1
