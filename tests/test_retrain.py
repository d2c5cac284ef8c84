"""The retraining loop in-process (Prefect test harness, SQLite MLflow in tmp): a first run is
gated and becomes champion; the same inputs again are skipped in seconds with nothing trained or
registered; a forced retrain that loses the gate keeps the champion and takes alias challenger."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
from flow_harness import flow_harness

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def retrain_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A throwaway Prefect server, MLflow store and needle state dir; yields the tracking URI."""
    with flow_harness(tmp_path_factory.mktemp("retrain")) as uri:
        yield uri


def _artifact(key: str) -> Any:
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    async def read() -> Any:
        async with get_client() as c:
            return await c.read_latest_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))

    (art,) = asyncio.run(read())
    return art


def test_skip_gate_and_losing_challenger(retrain_env: str, tiny_flow_params: dict[str, Any], tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    from flows.finetune import needle
    from flows.params import FinetuneParams

    client = MlflowClient(tracking_uri=retrain_env)
    landing = tmp_path / "landing"
    landing.mkdir()
    rows = Path(tiny_flow_params["data"]).read_text().splitlines(keepends=True)
    (landing / "part-1.jsonl").write_text("".join(rows[:40]))
    (landing / "part-2.jsonl").write_text("".join(rows[40:]))
    params = {**tiny_flow_params, "data": str(landing)}

    started = time.perf_counter()
    first = needle(FinetuneParams(**params))
    first_s = time.perf_counter() - started
    assert first["decision"] == "promoted: no champion yet"
    assert first["model_version"] == {"name": "needle", "version": "1", "champion": True, "alias": "champion"}
    v1 = client.get_model_version("needle", "1")
    for key in ("train_key", "data_digest", "base_key", "base_source", "config_key", "gate_fingerprint",
                "git_commit", "prefect.flow_run_id", "gate.exact_match", "decision"):
        assert v1.tags.get(key), key
    assert v1.tags["data_digest"] == first["data_digest"]

    # The same rows under other names: unchanged by content, skipped in seconds.
    (landing / "part-2.jsonl").rename(landing / "renamed.jsonl")
    started = time.perf_counter()
    second = needle(FinetuneParams(**params))
    second_s = time.perf_counter() - started
    assert second["skipped"] and second["decision"] == "skipped: data unchanged"
    assert second["same_version"]["version"] == "1" and second["model_version"] is None
    print(f"first run {first_s:.1f} s, skipped run {second_s:.1f} s")
    assert second_s < 0.25 * first_s, (second_s, first_s)
    run = client.get_run(second["run_id"])
    assert run.info.status == "FINISHED" and run.data.tags["decision"] == "skipped: data unchanged"
    assert "loss" not in run.data.metrics  # nothing trained
    assert len(client.search_model_versions("name = 'needle'")) == 1
    assert "skipped: data unchanged" in _artifact("needle-decision").data

    # Forced, under a rule no model can pass: version 2 loses, v1 stays champion, v2 is challenger.
    third = needle(FinetuneParams(**params, force=True, gate={"margin": 1.0}))
    assert third["decision"].startswith("rejected: exact_match")
    assert third["model_version"]["alias"] == "challenger" and third["model_version"]["version"] == "2"
    assert str(client.get_model_version_by_alias("needle", "champion").version) == "1"
    assert str(client.get_model_version_by_alias("needle", "challenger").version) == "2"
    v2, v1 = client.get_model_version("needle", "2"), client.get_model_version("needle", "1")
    assert v2.tags["gate.champion_version"] == "1" and "gate.champion.exact_match" in v2.tags
    assert v2.tags["gate_fingerprint"] == v1.tags["gate_fingerprint"] == third["gate_fingerprint"]
    assert v2.tags["train_key"] == v1.tags["train_key"]  # same inputs, forced
    metrics = client.get_run(third["run_id"]).data.metrics
    assert {"gate_challenger_exact_match", "gate_champion_exact_match"} <= set(metrics)
    decision = json.loads(Path(client.download_artifacts(third["run_id"], "gate/decision.json", str(tmp_path))).read_text())
    assert decision["champion_version"] == "1" and not decision["promote"]
    table = json.loads(_artifact("needle-gate").data)
    assert {r["metric"] for r in table} >= {"exact_match", "valid_call_rate"}
    # Trained afresh, not resumed from the finished folder of the same inputs.
    assert sorted(m.step for m in client.get_metric_history(third["run_id"], "loss")) == [1, 2, 3, 4]
