"""The sweep's parameters: dotted keys into FinetuneParams, the space's checks, the parallelism.
The sweep itself (one parent, four children, one failing on purpose, the best gated) runs on the
real stack: tests/test_deployment_e2e.py::test_sweep_deployment_parent_and_children."""

from __future__ import annotations

import pytest


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
