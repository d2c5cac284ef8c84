"""End to end on loopback: the stack scripts start Prefect, MLflow and a worker in a temp dir,
prefect.yaml is deployed, and `prefect deployment run needle/finetune --watch` trains for real.
A good run is tracked and registered; a bad dataset fails with file:line, FAILED, no version.
The retraining loop: the same inputs again are skipped in under 10 % of the first run's time
with no new version; a forced challenger that loses keeps the champion and takes alias
challenger; `needle data add` starts runs by itself (a burst: at most two, never overlapping);
`needle/sweep` runs four trials as one parent and four children, one failing on purpose; with the
stack's Ray head and worker node, `cluster: {"workers": 2}` trains on them."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import time
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
    prefect_port, mlflow_port, ray_port = _free_port(), _free_port(), _free_port()
    env = {
        **os.environ,
        "NEEDLE_STACK_DIR": str(root / "stack"),
        "NEEDLE_STATE_DIR": str(root / "state"),
        "NEEDLE_BIN": str(BIN),
        "PREFECT_PORT": str(prefect_port),
        "MLFLOW_PORT": str(mlflow_port),
        # The local Ray cluster too (a head and one worker node) when the cluster extra is installed.
        "NEEDLE_RAY": "1" if importlib.util.find_spec("ray") else "0",
        "RAY_PORT": str(ray_port),
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


@pytest.fixture(scope="module")
def first_params(tiny_flow_params: dict[str, Any]) -> dict[str, Any]:
    """The first run's inputs: 40 steps each, so that it does real work even when compiled
    programs are cached on disk (4 tiny steps then take seconds, as long as a skip's bookkeeping)."""
    return {**tiny_flow_params, "base_steps": 40, "steps": 40}


@pytest.fixture(scope="module")
def first_run(stack: dict[str, str], first_params: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    """The module's first deployment run: trains the auto base and the LoRA, becomes champion."""
    return _run_deployment(stack, first_params)


_RUNS_SCRIPT = (
    "import asyncio, json, sys\n"
    "from prefect.client.orchestration import get_client\n"
    "from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId\n"
    "async def main():\n"
    "    async with get_client() as c:\n"
    "        d = await c.read_deployment_by_name(sys.argv[1])\n"
    "        runs = await c.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[d.id])))\n"
    "        print(json.dumps([{'id': str(r.id), 'name': r.name, 'state': r.state_type.value, 'state_name': r.state_name,\n"
    "                           'start': r.start_time.timestamp() if r.start_time else None,\n"
    "                           'end': r.end_time.timestamp() if r.end_time else None,\n"
    "                           'data': (r.parameters.get('params') or {}).get('data'),\n"
    "                           'auto': r.created_by.type if r.created_by else None} for r in runs]))\n"
    "asyncio.run(main())\n"
)


def _flow_runs(env: dict[str, str], deployment: str = "needle/finetune") -> list[dict[str, Any]]:
    """Every flow run of the deployment: id, name, state, start/end (unix seconds), params.data."""
    out = subprocess.run([sys.executable, "-c", _RUNS_SCRIPT, deployment], env=env, capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


_ARTIFACT_SCRIPT = (
    "import asyncio, sys\n"
    "from prefect.client.orchestration import get_client\n"
    "from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey\n"
    "async def main():\n"
    "    async with get_client() as c:\n"
    "        (a,) = await c.read_latest_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[sys.argv[1]])))\n"
    "        print(a.data)\n"
    "asyncio.run(main())\n"
)


def _artifact(env: dict[str, str], key: str) -> str:
    """The data of the latest Prefect artifact with this key (markdown text or a table as JSON)."""
    out = subprocess.run([sys.executable, "-c", _ARTIFACT_SCRIPT, key], env=env, capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def _seconds(env: dict[str, str], flow_run_id: str) -> float:
    """A flow run's wall time in Prefect: from its start (Running) to its end."""
    (run,) = [r for r in _flow_runs(env) if r["id"] == flow_run_id]
    return run["end"] - run["start"]


def test_deployment_trains_tracks_registers_and_fails_cleanly(
    stack: dict[str, str], first_run: subprocess.CompletedProcess[str], bad_data: Path, bad_line: int,
    tiny_flow_params: dict[str, Any],
) -> None:
    from mlflow.tracking import MlflowClient

    good = first_run
    assert good.returncode == 0, good.stdout[-3000:] + good.stderr[-3000:]
    client = MlflowClient(tracking_uri=stack["MLFLOW_TRACKING_URI"])
    exp = client.get_experiment_by_name("needle/finetune")
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.status == "FINISHED"
    assert run.data.tags["backend"] == "cpu" and run.data.tags["prefect.deployment"] == "finetune"
    assert run.data.params["lora.rank"] == "16" and run.data.params["model.preset"] == "tiny"
    assert "optim.lr" in run.data.params
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "loss")) == list(range(1, 41))
    assert "tuned_exact_match" in run.data.metrics and "base_valid_call_rate" in run.data.metrics
    versions = client.search_model_versions("name = 'needle'")
    assert [v.run_id for v in versions] == [run.info.run_id]
    assert run.data.tags["decision"] == "promoted: no champion yet"

    bad = _run_deployment(stack, {**tiny_flow_params, "data": str(bad_data)})
    assert bad.returncode == 1, bad.stdout[-3000:]
    assert f"{bad_data.name}:{bad_line}:" in _last_failed_message(stack)
    (failed,) = client.search_runs([exp.experiment_id], "attributes.status = 'FAILED'")
    assert f"{bad_data.name}:{bad_line}:" in failed.data.tags["failure_reason"]
    assert len(client.search_model_versions("name = 'needle'")) == 1


def test_unchanged_data_is_skipped_fast(
    stack: dict[str, str], first_run: subprocess.CompletedProcess[str], first_params: dict[str, Any]
) -> None:
    from mlflow.tracking import MlflowClient

    assert first_run.returncode == 0
    client = MlflowClient(tracking_uri=stack["MLFLOW_TRACKING_URI"])
    exp = client.get_experiment_by_name("needle/finetune")
    (first,) = client.search_runs([exp.experiment_id], "tags.decision = 'promoted: no champion yet'")
    n_versions = len(client.search_model_versions("name = 'needle'"))
    started = time.perf_counter()
    again = _run_deployment(stack, first_params)
    watch_s = time.perf_counter() - started
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    (skipped,) = client.search_runs([exp.experiment_id], "tags.decision = 'skipped: data unchanged'")
    assert skipped.info.status == "FINISHED" and "loss" not in skipped.data.metrics
    assert len(client.search_model_versions("name = 'needle'")) == n_versions  # nothing registered
    first_s = _seconds(stack, first.data.tags["prefect.flow_run_id"])
    second_s = _seconds(stack, skipped.data.tags["prefect.flow_run_id"])
    print(f"first run {first_s:.1f} s, skipped run {second_s:.1f} s in Prefect ({watch_s:.1f} s with --watch)")
    assert second_s < 0.1 * first_s, (second_s, first_s)
    assert skipped.data.tags["train_key"] == first.data.tags["train_key"]
    assert "skipped: data unchanged" in _artifact(stack, "needle-decision")


def test_losing_challenger_keeps_the_champion(stack: dict[str, str], first_run: subprocess.CompletedProcess[str],
                                              first_params: dict[str, Any], tmp_path: Path) -> None:  # fmt: skip
    from mlflow.tracking import MlflowClient

    assert first_run.returncode == 0
    client = MlflowClient(tracking_uri=stack["MLFLOW_TRACKING_URI"])
    champion = client.get_model_version_by_alias("needle", "champion")
    # Forced (same inputs), under a rule no model can pass: it must lose.
    lost = _run_deployment(stack, {**first_params, "force": True, "gate": {"margin": 1.0}})
    assert lost.returncode == 0, lost.stdout[-3000:] + lost.stderr[-3000:]
    challenger = client.get_model_version_by_alias("needle", "challenger")
    assert str(client.get_model_version_by_alias("needle", "champion").version) == str(champion.version)
    assert int(challenger.version) > int(champion.version)
    assert challenger.tags["decision"].startswith("rejected: exact_match")
    assert challenger.tags["gate.champion_version"] == str(champion.version)
    assert challenger.tags["gate_fingerprint"] == client.get_model_version("needle", champion.version).tags["gate_fingerprint"]
    assert challenger.tags["train_key"] == champion.tags["train_key"]  # the same inputs, forced
    for key in ("data_digest", "base_key", "base_source", "config_key", "git_commit", "prefect.flow_run_id",
                "gate.exact_match", "gate.champion.exact_match"):
        assert challenger.tags.get(key), key
    run_id = challenger.run_id
    assert {"gate_challenger_exact_match", "gate_champion_exact_match"} <= set(client.get_run(run_id).data.metrics)
    # Trained afresh, not resumed from the finished folder of the same inputs.
    assert sorted(m.step for m in client.get_metric_history(run_id, "loss")) == list(range(1, 41))
    decision = json.loads(Path(client.download_artifacts(run_id, "gate/decision.json", str(tmp_path))).read_text())
    assert decision["champion_version"] == str(champion.version) and not decision["promote"]
    table = json.loads(_artifact(stack, "needle-gate"))
    assert {r["metric"]: r["ok"] for r in table}["exact_match"] == "NO"


def _needle(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / "needle"), *args], env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)


def _wait_for(env: dict[str, str], landing: Path, n_min: int, timeout: float = 600) -> list[dict[str, Any]]:
    """Runs on the landing folder once at least n_min exist and none is waiting or running."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        runs = [r for r in _flow_runs(env) if r["data"] == str(landing)]
        if len(runs) >= n_min and all(r["state"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED") for r in runs):
            time.sleep(4)  # a run an event is still creating
            again = [r for r in _flow_runs(env) if r["data"] == str(landing)]
            if len(again) == len(runs) and all(r["state"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED") for r in again):
                return again
        time.sleep(2)
    raise AssertionError(f"runs on {landing} did not finish: {runs}")


def test_data_add_starts_runs_by_itself(
    stack: dict[str, str], first_run: subprocess.CompletedProcess[str], tiny_flow_params: dict[str, Any],
    sample_data: dict[str, Path], bad_data: Path, bad_line: int, tmp_path: Path,
) -> None:
    from mlflow.tracking import MlflowClient

    from needle.data.load import source_digest

    landing = tmp_path / "landing"
    overrides = json.dumps({k: v for k, v in tiny_flow_params.items() if k != "data"})
    refused = _needle(stack, "data", "add", str(bad_data), "--landing", str(landing))
    assert refused.returncode == 2 and f"{bad_data.name}:{bad_line}:" in refused.stderr
    assert not landing.exists() or not list(landing.iterdir())  # nothing landed
    rows = sample_data["new"].read_text().splitlines(keepends=True)
    parts = []
    for i, chunk in enumerate((rows[:40], rows[40:52], rows[52:])):
        parts.append(tmp_path / f"batch-{i}.jsonl")
        parts[-1].write_text("".join(chunk))
    # A burst: three files land one after another while the first run starts.
    outs = [_needle(stack, "data", "add", str(part), "--landing", str(landing), "--params", overrides) for part in parts]
    assert all(o.returncode == 0 for o in outs), [o.stderr[-1500:] for o in outs]
    assert "event needle.data.landed sent" in outs[0].stdout
    runs = _wait_for(stack, landing, 1)
    print("runs started by needle data add:", [(r["name"], r["state_name"], r["auto"]) for r in runs])
    assert 1 <= len(runs) <= 2 and all(r["state"] == "COMPLETED" for r in runs)
    spans = sorted((r["start"], r["end"]) for r in runs)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))  # never overlapping
    client = MlflowClient(tracking_uri=stack["MLFLOW_TRACKING_URI"])
    digest = source_digest(str(landing))
    trained = [v for v in client.search_model_versions("name = 'needle'") if v.tags.get("data_digest") == digest]
    assert trained, "no version trained on everything that landed"


def test_sweep_deployment_parent_and_children(stack: dict[str, str], first_run: subprocess.CompletedProcess[str],
                                              tiny_flow_params: dict[str, Any], tmp_path: Path) -> None:  # fmt: skip
    from mlflow.tracking import MlflowClient

    assert first_run.returncode == 0  # a champion for the best trial to face

    params = {"base": tiny_flow_params, "n_trials": 4, "sampler": "grid", "n_jobs": 2,
              "space": {"lora.rank": {"type": "categorical", "choices": [2, 4, 0, 8]}}}  # rank 0 fails on purpose
    cmd = ["prefect", "deployment", "run", "needle/sweep", "--watch", "--param", f"params={json.dumps(params)}"]
    out = subprocess.run(cmd, env=stack, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    client = MlflowClient(tracking_uri=stack["MLFLOW_TRACKING_URI"])
    exp = client.get_experiment_by_name("needle/sweep")
    (parent,) = client.search_runs([exp.experiment_id], "tags.sweep = 'parent'")
    children = client.search_runs([exp.experiment_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    assert sorted(c.info.status for c in children) == ["FAILED", "FINISHED", "FINISHED", "FINISHED"]
    (failed,) = [c for c in children if c.info.status == "FAILED"]
    assert "rank" in failed.data.tags["failure_reason"]
    assert json.loads(parent.data.params["sweep.space"])["lora.rank"]["choices"] == [2, 4, 0, 8]
    assert parent.data.tags["sweep.n_complete"] == "3" and parent.data.tags["sweep.n_failed"] == "1"
    assert [f.path for f in client.list_artifacts(parent.info.run_id, "plots")] == ["plots/objective.png"]
    done = [c for c in children if c.info.status == "FINISHED"]
    assert {c.data.params["lora.rank"] for c in done} == {"2", "4", "8"}
    best = parent.data.tags["sweep.best_run_id"]
    assert best in {c.info.run_id for c in done}
    # The best trial's model went through the gate against the champion and was registered.
    (version,) = [v for v in client.search_model_versions("name = 'needle'") if v.run_id == best]
    assert version.tags["sweep.parent_run_id"] == parent.info.run_id
    assert version.tags["gate.champion_version"] != "none" and version.tags["decision"]
    assert all(set(c.data.params) == set(done[0].data.params) for c in done)
    assert all(set(c.data.metrics) - {k for k in c.data.metrics if k.startswith("system/")}
               == set(done[0].data.metrics) - {k for k in done[0].data.metrics if k.startswith("system/")} for c in done)
    if shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome"):
        ui = subprocess.run([sys.executable, str(ROOT / "deployments" / "check_compare_ui.py"), "--experiment",
                             "needle/sweep", "--parent", parent.info.run_id, "--out", str(tmp_path / "ui")],
                            env=stack, capture_output=True, text=True, timeout=600)  # fmt: skip
        assert ui.returncode == 0, ui.stdout[-3000:] + ui.stderr[-3000:]


def test_deployment_trains_on_the_stacks_ray_workers(stack: dict[str, str], first_run: subprocess.CompletedProcess[str],
                                                     tiny_flow_params: dict[str, Any]) -> None:  # fmt: skip
    """NEEDLE_RAY=1: the flow run finds the stack's Ray through RAY_ADDRESS (the worker's
    environment) and trains on two Ray workers there, one a node each (last: it adds a run)."""
    pytest.importorskip("ray")
    from mlflow.tracking import MlflowClient

    assert first_run.returncode == 0
    params = {**tiny_flow_params, "cluster": {"workers": 2}, "force": True, "register_model": False}
    out = _run_deployment(stack, params)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    client = MlflowClient(tracking_uri=stack["MLFLOW_TRACKING_URI"])
    exp = client.get_experiment_by_name("needle/finetune")
    (run,) = client.search_runs([exp.experiment_id], "params.`cluster.workers` = '2'")
    assert run.info.status == "FINISHED" and run.data.params["devices"] == "2"
    assert run.data.params["cluster.ray"] == f"127.0.0.1:{stack['RAY_PORT']}"
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "loss")) == [1, 2, 3, 4]


def test_sweep_spreads_its_trials_over_the_stacks_ray_workers(
    stack: dict[str, str], first_run: subprocess.CompletedProcess[str], tiny_flow_params: dict[str, Any], tmp_path: Path
) -> None:
    """`needle/sweep` with `cluster`: four trials train on the stack's two Ray nodes, two at a time
    (one a node), the study in a SQLite storage; one parent, four children, the best gated and
    registered (last with the test above: it adds runs and a version)."""
    pytest.importorskip("ray")
    import optuna
    from mlflow.tracking import MlflowClient

    assert first_run.returncode == 0
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    address = f"127.0.0.1:{stack['RAY_PORT']}"
    params = {"base": tiny_flow_params, "n_trials": 4, "sampler": "grid", "cluster": {"workers": 1}, "storage": storage,
              "space": {"lora.rank": {"type": "categorical", "choices": [2, 4, 6, 8]}}}  # fmt: skip
    cmd = ["prefect", "deployment", "run", "needle/sweep", "--watch", "--param", f"params={json.dumps(params)}"]
    out = subprocess.run(cmd, env=stack, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    client = MlflowClient(tracking_uri=stack["MLFLOW_TRACKING_URI"])
    exp = client.get_experiment_by_name("needle/sweep")
    (parent,) = client.search_runs([exp.experiment_id], f"tags.sweep = 'parent' and params.`sweep.cluster` = '{address}'")
    assert parent.data.params["sweep.n_jobs"] == "2"  # the cluster's two CPUs, one worker a trial
    children = client.search_runs([exp.experiment_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    assert [c.info.status for c in children] == ["FINISHED"] * 4
    assert all(c.data.params["cluster.ray"] == address for c in children)
    assert len({c.data.params["cluster.node"] for c in children}) == 2  # both nodes trained trials
    spans = sorted((c.info.start_time, c.info.end_time) for c in children)
    assert any(later[0] < earlier[1] for earlier, later in zip(spans, spans[1:]))  # trials overlapped
    study = optuna.load_study(study_name=parent.data.params["sweep.study"], storage=storage)
    assert [t.state for t in study.trials] == [optuna.trial.TrialState.COMPLETE] * 4
    best = parent.data.tags["sweep.best_run_id"]
    (version,) = [v for v in client.search_model_versions("name = 'needle'") if v.run_id == best]
    assert version.tags["sweep.parent_run_id"] == parent.info.run_id
