"""The sweep flow: an Optuna study as one parent MLflow run with a child run per trial; a failing
trial is recorded and the sweep goes on; the best trial's model goes through the gate."""

from __future__ import annotations

import json
from typing import Any, Iterator

import pytest
from flow_harness import flow_harness


def test_trial_params_set_dotted_keys_and_validate() -> None:
    from flows.params import FinetuneParams
    from flows.sweep import SweepParams, n_parallel

    p = SweepParams(base=FinetuneParams(preset="tiny", steps=3, lora={"rank": 4}), n_trials=3, sampler="grid",
                    space={"lora.rank": {"type": "categorical", "choices": [2, 8]}})
    tp = p.trial_params({"lora.rank": 8, "optim.lr": 0.01, "train.log_every": 1})
    assert tp.lora.rank == 8 and tp.optim.lr == 0.01 and tp.train == {"log_every": 1} and tp.steps == 3
    assert tp.force  # a trial always trains
    with pytest.raises(ValueError):
        p.trial_params({"lora.rank": 0})
    assert 1 <= n_parallel(p) <= 3
    with pytest.raises(ValueError, match="categorical"):
        SweepParams(sampler="grid", space={"optim.lr": {"type": "float", "low": 1e-3, "high": 1e-2}})
    with pytest.raises(ValueError):
        SweepParams(space={"optim.lr": {"type": "float", "low": 1e-2, "high": 1e-3}})


@pytest.fixture(scope="module")
def sweep_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with flow_harness(tmp_path_factory.mktemp("sweep")) as uri:
        yield uri


@pytest.mark.slow
def test_four_trial_sweep_one_failing(sweep_env: str, tiny_flow_params: dict[str, Any]) -> None:
    from mlflow.tracking import MlflowClient

    from flows.sweep import SweepParams, needle_sweep

    # Rank 0 is refused by LoraConfig: that trial fails on purpose.
    p = SweepParams(base=tiny_flow_params, n_trials=4, sampler="grid", n_jobs=2,
                    space={"lora.rank": {"type": "categorical", "choices": [2, 4, 0, 8]}})
    result = needle_sweep(p)
    client = MlflowClient(tracking_uri=sweep_env)
    parent = client.get_run(result["run_id"])
    assert parent.info.status == "FINISHED"
    assert json.loads(parent.data.params["sweep.space"])["lora.rank"]["choices"] == [2, 4, 0, 8]
    assert parent.data.tags["sweep.n_complete"] == "3" and parent.data.tags["sweep.n_failed"] == "1"
    children = client.search_runs([parent.info.experiment_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    assert len(children) == 4
    failed = [c for c in children if c.info.status == "FAILED"]
    done = [c for c in children if c.info.status == "FINISHED"]
    assert len(failed) == 1 and "rank" in failed[0].data.tags["failure_reason"]
    assert len(done) == 3
    assert all(set(c.data.params) == set(done[0].data.params) for c in done)  # compare key by key
    assert {c.data.params["lora.rank"] for c in done} == {"2", "4", "8"}
    assert parent.data.tags["sweep.best_run_id"] in {c.info.run_id for c in done}
    assert [f.path for f in client.list_artifacts(parent.info.run_id, "plots")] == ["plots/objective.png"]
    # The best trial's model went through the gate and was registered from its child run.
    (version,) = client.search_model_versions("name = 'needle'")
    assert version.run_id == parent.data.tags["sweep.best_run_id"]
    assert version.tags["decision"] == result["decision"] == "promoted: no champion yet"
    assert version.tags["sweep.parent_run_id"] == parent.info.run_id and version.tags["gate_fingerprint"]
    assert [t["state"] for t in result["trials"]].count("FAIL") == 1
