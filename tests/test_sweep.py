"""The sweep's parameters: dotted keys into FinetuneParams, the space's checks, the parallelism.
The sweep itself (one parent, four children, one failing on purpose, the best gated) runs on the
real stack: tests/test_deployment_e2e.py::test_sweep_deployment_parent_and_children, and spread
over the stack's Ray nodes: ::test_sweep_spreads_its_trials_over_the_stacks_ray_workers."""

from __future__ import annotations

import pytest


def test_trial_params_set_dotted_keys_and_validate() -> None:
    from needle_flows.params import FinetuneParams
    from needle_flows.sweep import SweepParams, n_parallel

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


def test_a_sweep_on_ray_runs_as_many_trials_as_the_cluster_holds_and_needs_a_cluster(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from needle_flows.sweep import SweepParams, join_cluster, n_parallel

    p = SweepParams(n_trials=8, cluster={"workers": 2})
    assert n_parallel(p, cluster_cpus=6) == 3 and n_parallel(p, cluster_cpus=1) == 1
    assert n_parallel(SweepParams(n_trials=2, cluster={"workers": 1}), cluster_cpus=6) == 2
    assert join_cluster(SweepParams()) == (None, None)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(ValueError, match="RAY_ADDRESS"):
        join_cluster(p)
    with pytest.raises(ValueError):
        SweepParams(cluster={"workers": 0})
