"""Checkpointer: orbax round trip, keep-last-N, refusing a checkpoint of another run."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from train_helpers import make_state

from needle.config import OptimConfig
from needle.errors import CheckpointMismatchError
from needle.train.checkpoint import Checkpointer, build_meta, diff_meta
from needle.train.step import TrainState

META = build_meta(
    fingerprint="data-abc",
    configs={"optim": OptimConfig(lr=1e-2), "lora": None},
    tokenizer_sha256="tok-1",
    tokenizer_path="/somewhere/tokenizer.json",
)


def perturbed(state: TrainState, step: int) -> TrainState:
    """The state with every float leaf shifted by seeded noise, as if trained for ``step`` steps."""
    key = jax.random.PRNGKey(step)

    def shift(x: jax.Array) -> jax.Array:
        return x + jax.random.normal(key, x.shape, x.dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x

    return state.replace(
        step=jnp.asarray(step, jnp.int32),
        trainable=jax.tree.map(shift, state.trainable),
        opt_state=jax.tree.map(shift, state.opt_state),
        rng=jax.random.PRNGKey(100 + step),
    )


def assert_trees_equal(a, b) -> None:
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.slow  # builds the LoRA model's params
def test_round_trip_restores_params_optimizer_step_and_rng(tmp_path: Path) -> None:
    template = make_state("lora")
    saved = perturbed(template, 3)
    ckpt = Checkpointer(tmp_path / "ckpt", keep=2)
    assert ckpt.restore_latest(template, META) is None  # nothing saved yet
    assert ckpt.save(saved, META)
    ckpt.close()

    restored, meta = Checkpointer(tmp_path / "ckpt").restore_latest(make_state("lora"), META)
    assert int(restored.step) == 3 and meta["step"] == 3 and meta["shuffle_position"] == 3
    assert meta["fingerprint"] == "data-abc" and meta["optim"]["lr"] == 1e-2
    for name in ("trainable", "opt_state", "rng"):
        assert_trees_equal(getattr(restored, name), getattr(saved, name))
    # Frozen params are not in the checkpoint: they come from the template (the base model).
    assert_trees_equal(restored.frozen, template.frozen)
    assert restored.tx == template.tx and restored.apply_fn == template.apply_fn


def test_keeps_only_the_last_n_and_skips_an_existing_step(tmp_path: Path) -> None:
    state = make_state("scratch")
    ckpt = Checkpointer(tmp_path, keep=2)
    for step in (1, 2, 3):
        assert ckpt.save(state.replace(step=jnp.asarray(step, jnp.int32)), META)
    ckpt.wait()
    assert not ckpt.save(state.replace(step=jnp.asarray(3, jnp.int32)), META)
    ckpt.close()
    assert Checkpointer(tmp_path).all_steps() == [2, 3]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.isdigit()) == ["2", "3"]


def test_refuses_a_checkpoint_of_other_data_or_config(tmp_path: Path) -> None:
    state = make_state("scratch")
    ckpt = Checkpointer(tmp_path)
    ckpt.save(state, META)
    ckpt.wait()
    other = build_meta(
        fingerprint="data-xyz", configs={"optim": OptimConfig(lr=2e-2), "lora": None}, tokenizer_sha256="tok-1"
    )
    with pytest.raises(CheckpointMismatchError) as err:
        ckpt.restore_latest(state, other)
    message = str(err.value)
    assert "fingerprint" in message and "data-abc" in message and "data-xyz" in message
    assert "optim.lr" in message
    ckpt.close()


def test_diff_meta_ignores_runtime_keys_and_tuple_vs_list() -> None:
    saved = {**META, "step": 7, "shuffle_position": 7, "tokenizer_path": "/elsewhere", "targets": ["q", "v"]}
    assert diff_meta({**META, "targets": ("q", "v")}, saved) == []
    assert diff_meta({**META, "tokenizer_sha256": "tok-2"}, saved) == ["targets", "tokenizer_sha256"]
