"""train_step / eval_step / optimizer on the tiny model: learning, LoRA freezing, accumulation."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from train_helpers import LORA, make_plan, make_state, tiny_model_cfg

from needle.config import OptimConfig
from needle.train.step import (
    count_micro_batches, decay_mask, eval_step, loss_and_grads, make_schedule, micro_batches_of, train_step,
)  # fmt: skip

step_fn = jax.jit(train_step)  # not donated: the tests compare before and after


def leaves(tree) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_step_changes_params_and_lowers_loss_on_a_repeated_batch() -> None:
    state = make_state("scratch")
    before = leaves(state.trainable)
    batch = make_plan().batch(0)
    losses = []
    for _ in range(6):
        state, metrics = step_fn(state, batch)
        losses.append(float(metrics["loss"]))
    assert int(state.step) == 6
    assert losses[-1] < losses[0] - 0.1, losses
    assert any(not np.array_equal(a, b) for a, b in zip(before, leaves(state.trainable)))


def test_lora_step_changes_only_adapters_and_leaves_frozen_bit_identical() -> None:
    state = make_state("lora")
    names = {"/".join(str(k.key) for k in path) for path, _ in jax.tree_util.tree_leaves_with_path(state.trainable)}
    assert names and all(n.endswith(("lora_a", "lora_b")) for n in names)
    frozen_before, trainable_before = leaves(state.frozen), leaves(state.trainable)
    batch = make_plan().batch(0)
    for _ in range(2):
        state, _ = step_fn(state, batch)
    assert all(np.array_equal(a, b) for a, b in zip(frozen_before, leaves(state.frozen)))
    changed = [not np.array_equal(a, b) for a, b in zip(trainable_before, leaves(state.trainable))]
    assert all(changed), "every adapter leaf should move after two steps"


def test_metrics_are_finite_and_count_loss_tokens() -> None:
    state = make_state("scratch")
    batch = make_plan().batch(1)
    _, metrics = step_fn(state, batch)
    values = {k: float(v) for k, v in metrics.items()}
    assert set(values) == {"loss", "grad_norm", "lr", "tokens", "finite"}
    assert values["finite"] == 1.0
    assert all(np.isfinite(v) for v in values.values())
    assert values["tokens"] == float(batch["mask"].sum())
    assert values["lr"] == pytest.approx(1e-2)  # no warmup: the peak at step 0
    assert values["grad_norm"] > 0


@pytest.mark.slow  # two more compilations of the step
def test_grad_accumulation_equals_one_big_batch() -> None:
    batch = make_plan(batch_size=4).batch(0)
    # Rows carry different numbers of loss tokens, so a per-micro-batch mean would differ.
    assert len(set(batch["mask"].sum(axis=1).tolist())) > 1
    grads_fn = jax.jit(loss_and_grads)
    loss1, tokens1, grads1 = grads_fn(make_state("scratch", grad_accum=1), batch)
    loss2, tokens2, grads2 = grads_fn(make_state("scratch", grad_accum=2), batch)
    assert float(tokens1) == float(tokens2) == float(batch["mask"].sum())
    np.testing.assert_allclose(float(loss2), float(loss1), rtol=1e-5, atol=1e-5)
    for a, b in zip(leaves(grads1), leaves(grads2)):
        np.testing.assert_allclose(b, a, atol=1e-5)
    # A batch that already carries the micro-batch axis [A, B/A, T] gives the same gradient.
    split = {k: v.reshape(2, 2, *v.shape[1:]) for k, v in batch.items()}
    loss3, _, grads3 = grads_fn(make_state("scratch", grad_accum=2), split)
    np.testing.assert_allclose(float(loss3), float(loss1), rtol=1e-5)
    for a, b in zip(leaves(grads1), leaves(grads3)):
        np.testing.assert_allclose(b, a, atol=1e-5)


def test_count_micro_batches_halves_while_a_micro_batch_keeps_the_tokens() -> None:
    assert count_micro_batches(16, 1024, 1, 4096) == 4  # 4 rows of 1024 tokens each
    assert count_micro_batches(16, 2048, 1, 4096) == 8
    assert count_micro_batches(16, 1024, 2, 4096) == 4  # grad_accum's split first, then halves
    assert count_micro_batches(16, 1024, 8, 4096) == 8  # already below the target: kept
    assert count_micro_batches(16, 1024, 1, 0) == 1  # off
    assert count_micro_batches(6, 1024, 1, 1024) == 2  # 3 rows do not halve
    assert count_micro_batches(16, 1024, 1, 1024, shards=8) == 2  # rows stay a multiple of the devices


def test_backend_micro_batches_equal_one_big_batch() -> None:
    """settings.micro_batch_tokens (a TPU's default) splits the step's batch; the gradient stays the batch's."""
    import dataclasses

    from needle.hardware import settings_for
    from needle.model.decoder.transformer import Transformer
    from needle.train.run import make_apply_fn

    batch = make_plan(batch_size=4).batch(0)
    rows, seq = batch["inputs"].shape
    whole = make_state("lora")
    settings = dataclasses.replace(settings_for("cpu"), micro_batch_tokens=seq)  # one row a micro-batch
    split = whole.replace(apply_fn=make_apply_fn(Transformer(tiny_model_cfg(), LORA, settings)))
    assert micro_batches_of(whole, batch) == 1 and micro_batches_of(split, batch) == rows
    loss1, tokens1, grads1 = jax.jit(loss_and_grads)(whole, batch)
    loss2, tokens2, grads2 = jax.jit(loss_and_grads)(split, batch)
    assert float(tokens1) == float(tokens2)
    np.testing.assert_allclose(float(loss2), float(loss1), rtol=1e-5)
    for a, b in zip(leaves(grads1), leaves(grads2)):
        np.testing.assert_allclose(b, a, atol=1e-6)


def test_finite_flag_is_false_once_the_update_makes_the_state_nan() -> None:
    # lr 1e4 on the tiny model: step 6 still reports a finite loss, but its update is NaN.
    state = make_state("scratch", steps=16, optim=OptimConfig(lr=1e4, warmup_steps=0))
    plan, flags = make_plan(), []
    for i in range(6):
        state, metrics = step_fn(state, plan.batch(i))
        flags.append(bool(metrics["finite"]))
    assert np.isfinite(float(metrics["loss"])) and not np.isfinite(float(metrics["grad_norm"]))
    assert flags == [True] * 5 + [False]
    assert not all(np.isfinite(x).all() for x in leaves(state.trainable))


def test_batch_without_loss_tokens_gives_zero_loss_not_nan() -> None:
    batch = make_plan().batch(0)
    batch["mask"] = np.zeros_like(batch["mask"])
    state = make_state("scratch")
    _, metrics = step_fn(state, batch)
    assert float(metrics["loss"]) == 0.0 and float(metrics["grad_norm"]) == 0.0


def test_eval_step_matches_the_training_loss() -> None:
    state = make_state("scratch")
    batch = make_plan().batch(2)
    out = jax.jit(eval_step)(state, batch)
    _, metrics = step_fn(state, batch)
    assert float(out["tokens"]) == float(batch["mask"].sum())
    np.testing.assert_allclose(float(out["loss_sum"]) / float(out["tokens"]), float(metrics["loss"]), rtol=1e-6)


def test_schedule_warms_up_then_decays_to_min_lr() -> None:
    optim = OptimConfig(lr=1e-3, warmup_steps=10, min_lr_ratio=0.1)
    lr = make_schedule(optim, total_steps=100)
    assert float(lr(0)) == 0.0
    assert float(lr(10)) == pytest.approx(1e-3)
    assert float(lr(100)) == pytest.approx(1e-4)
    assert float(lr(5)) == pytest.approx(5e-4)
    # Warmup longer than the run is clamped instead of never reaching the peak.
    short = make_schedule(optim, total_steps=3)
    assert float(short(2)) == pytest.approx(1e-3)


def test_weight_decay_skips_norms_and_embeddings() -> None:
    mask = decay_mask(make_state("scratch").trainable)
    flat = {"/".join(str(k.key) for k in p): v for p, v in jax.tree_util.tree_leaves_with_path(mask)}
    assert flat["embed/embedding"] is False
    assert not any(v for k, v in flat.items() if k.endswith("scale"))
    assert any(v for k, v in flat.items() if k.endswith("kernel"))


@pytest.mark.parametrize("mode", ["scratch", "lora"])
def test_packed_loss_and_grads_equal_the_same_rows_unpacked(mode: str) -> None:
    """A packed batch's loss is the token-weighted loss of its rows unpacked, and so is its gradient."""
    from train_helpers import synthetic_split

    from needle.data.batching import PackedPlan

    split = synthetic_split(12, seed=3)
    packed = PackedPlan(split, batch_size=4, seq_len=64, seed=0).batch(0)
    segs = packed["segment_ids"]
    assert segs.max(axis=1).sum() > segs.shape[0]  # sequences hold several rows (and some padding)
    # The same rows, one per padded row of 32 tokens (plain causal attention, positions 0..).
    rows = []
    for r in range(segs.shape[0]):
        for s in range(1, int(segs[r].max()) + 1):
            idx = np.flatnonzero(segs[r] == s)
            rows.append({k: packed[k][r, idx] for k in ("inputs", "targets", "mask")})
    plain = {k: np.zeros((len(rows), 32), np.float32 if k == "mask" else np.int32) for k in ("inputs", "targets", "mask")}
    for i, row in enumerate(rows):
        for k, v in row.items():
            plain[k][i, : len(v)] = v
    state = make_state(mode)
    f = jax.jit(loss_and_grads)
    loss_p, tok_p, grads_p = f(state, packed)
    loss_u, tok_u, grads_u = f(state, plain)
    assert float(tok_p) == float(tok_u) == float(sum(r["mask"].sum() for r in rows))
    assert abs(float(loss_p) - float(loss_u)) < 1e-5
    for gp, gu in zip(leaves(grads_p), leaves(grads_u)):
        np.testing.assert_allclose(gp, gu, atol=1e-5, rtol=1e-4)
