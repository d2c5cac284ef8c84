"""The loop: hook cadence, validation, NaN stop keeping the last good checkpoint, exact resume."""

from __future__ import annotations

import logging
from pathlib import Path

import jax
import numpy as np
import pytest
from train_helpers import make_packed_plan, make_plan, make_state, train_cfg

from needle.config import OptimConfig
from needle.data.batching import BatchPlan
from needle.errors import NonFiniteLossError
from needle.train.checkpoint import Checkpointer
from needle.train.loop import Hook, checkpoint_hook, metrics_hook, train

META = {"fingerprint": "synthetic", "config": {"steps": 6}}


class PoisonedPlan:
    """A BatchPlan whose batch at ``bad_index`` has a NaN loss mask."""

    def __init__(self, plan: BatchPlan, bad_index: int) -> None:
        self.plan, self.bad_index = plan, bad_index

    def batch(self, step: int) -> dict[str, np.ndarray]:
        batch = self.plan.batch(step)
        if step == self.bad_index:
            batch["mask"] = batch["mask"] * np.float32("nan")
        return batch

    def eval_batches(self):
        return self.plan.eval_batches()


class StopAt(Exception):
    """Raised by a hook to end a run early, like a crash between checkpoints."""


def params_of(state) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(state.trainable)]


def test_hooks_run_on_their_cadence_with_fetched_metrics(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    seen: list[tuple[int, dict]] = []
    ckpt = Checkpointer(tmp_path, keep=5)
    hooks = [metrics_hook(lambda m, step: seen.append((step, m)), every=2), checkpoint_hook(ckpt, META, every=3)]
    cfg = train_cfg(steps=6, log_every=2, eval_every=3)
    with caplog.at_level(logging.INFO, logger="needle.train.loop"):
        result = train(make_state(steps=6), make_plan(), cfg, hooks=hooks, val_plan=make_plan(n_rows=8, seed=5))
    ckpt.close()
    assert [s for s, _ in seen] == [2, 4, 6]
    assert Checkpointer(tmp_path).all_steps() == [3, 6]
    assert [r["step"] for r in result.history] == [2, 3, 4, 6]
    for record in result.history:
        assert np.isfinite(record["loss"]) and record["tokens_per_s"] > 0 and record["step_time_s"] > 0
        assert record["tokens"] > 0 and record["lr"] > 0
    # Validation ran at 3 and 6, before the metrics hook, which therefore saw it at step 6.
    assert [r["step"] for r in result.history if "val_loss" in r] == [3, 6]
    assert "val_loss" in seen[-1][1] and result.val_loss == result.history[-1]["val_loss"]
    assert result.final_step == 6 and int(result.state.step) == 6
    assert result.train_loss == result.history[-1]["loss"] and result.tokens_per_s > 0
    assert "step 6/6 loss" in caplog.text  # plain log lines when stdout is not a terminal


def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path, keep=5)
    # Metrics are only fetched at checkpoints (3, 6): the NaN of step 5 is caught at 6,
    # before that bad state is saved.
    cfg = train_cfg(steps=6, log_every=100, checkpoint_every=3)
    with pytest.raises(NonFiniteLossError, match="at step 5"):
        train(make_state(steps=6), PoisonedPlan(make_plan(), bad_index=4), cfg, hooks=[checkpoint_hook(ckpt, META, 3)])
    ckpt.close()
    ckpt = Checkpointer(tmp_path)
    assert ckpt.all_steps() == [3]
    state, _ = ckpt.restore_latest(make_state(steps=6), META)
    assert all(np.isfinite(p).all() for p in params_of(state))
    ckpt.close()


def test_a_nan_state_behind_a_finite_loss_is_never_saved(tmp_path: Path) -> None:
    # lr 1e4: step 6 reports a finite loss while its update turns every param NaN. Metrics are
    # fetched only when a checkpoint is due (3, 6): the flag of every step is checked there.
    ckpt = Checkpointer(tmp_path, keep=5)
    cfg = train_cfg(steps=12, log_every=100, checkpoint_every=3)
    state = make_state(steps=12, optim=OptimConfig(lr=1e4, warmup_steps=0))
    with pytest.raises(NonFiniteLossError, match="at step 6: loss 4.15") as err:
        train(state, make_plan(), cfg, hooks=[checkpoint_hook(ckpt, META, 3)], progress=False)
    ckpt.close()
    assert "grad_norm nan" in str(err.value) and "the last good checkpoint is kept" in str(err.value)
    ckpt = Checkpointer(tmp_path)
    assert ckpt.all_steps() == [3]
    restored, _ = ckpt.restore_latest(make_state(steps=12), META)
    assert all(np.isfinite(p).all() for p in params_of(restored))
    ckpt.close()


@pytest.mark.parametrize("packed", [False, True], ids=["bucketed", "packed"])
def test_resume_after_a_stop_between_saves_matches_the_uninterrupted_run(tmp_path: Path, packed: bool) -> None:
    # Packed: 24 rows in about 10 sequences, 2 per batch, so the 6 steps cross an epoch boundary.
    make_plan_ = make_packed_plan if packed else make_plan
    cfg = train_cfg(steps=6, log_every=1, checkpoint_every=3)
    full = train(make_state(steps=6), make_plan_(), cfg)

    ckpt = Checkpointer(tmp_path)

    def crash(info):
        if info.step == 5:
            raise StopAt(info.step)

    with pytest.raises(StopAt):
        train(make_state(steps=6), make_plan_(), cfg, hooks=[checkpoint_hook(ckpt, META, 3), Hook(crash, 1)])
    restored, meta = ckpt.restore_latest(make_state(steps=6), META)
    assert meta["step"] == 3
    resumed = train(restored, make_plan_(), cfg, start_step=meta["step"], hooks=[checkpoint_hook(ckpt, META, 3)])
    ckpt.close()
    assert [r["step"] for r in resumed.history] == [4, 5, 6]
    np.testing.assert_allclose(
        [r["loss"] for r in resumed.history], [r["loss"] for r in full.history[3:]], atol=1e-6
    )
    for a, b in zip(params_of(full.state), params_of(resumed.state)):
        np.testing.assert_allclose(b, a, atol=1e-6)
    assert np.array_equal(np.asarray(full.state.rng), np.asarray(resumed.state.rng))


def test_step_programs_compile_once_per_key_and_are_reused_in_process() -> None:
    from needle.train import programs
    from needle.train.step import train_step

    programs._MEMORY.clear()
    plan = make_packed_plan()
    first = programs.StepPrograms(train_step, donate=False)
    state_a, metrics_a = first(make_state(), plan.batch(0))
    first(state_a, plan.batch(1))  # same shape: the same program
    assert first.stats == {"compiled": 1, "reused": 0}
    # A second train call of the same layout (a resume) reuses it and computes the same step.
    second = programs.StepPrograms(train_step, donate=False)
    _, metrics_b = second(make_state(), plan.batch(0))
    assert second.stats == {"compiled": 0, "reused": 1}
    assert float(metrics_a["loss"]) == float(metrics_b["loss"])
    # Another optimizer is another program (the state's static fields are in the key).
    other = programs.StepPrograms(train_step, donate=False)
    other(make_state(optim=OptimConfig(lr=0.5, warmup_steps=0)), plan.batch(0))
    assert other.stats == {"compiled": 1, "reused": 0}
