"""Checkpointer: orbax round trip, keep-last-N, refusing another run's checkpoint, damage fallback."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from train_helpers import make_state

from needle.config import OptimConfig
from needle.errors import CheckpointDamagedError, CheckpointMismatchError, NeedleError
from needle.train.checkpoint import (
    CHECKSUM_FILE,
    Checkpointer,
    build_meta,
    diff_meta,
    verify_checksums,
    write_checksums,
)
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
        fingerprint="data-xyz", configs={"optim": OptimConfig(weight_decay=0.5), "lora": None}, tokenizer_sha256="tok-1"
    )
    with pytest.raises(CheckpointMismatchError) as err:
        ckpt.restore_latest(state, other)
    message = str(err.value)
    assert "fingerprint" in message and "data-abc" in message and "data-xyz" in message
    assert "optim.weight_decay" in message
    ckpt.close()


def test_diff_meta_ignores_runtime_keys_and_tuple_vs_list() -> None:
    saved = {**META, "step": 7, "shuffle_position": 7, "tokenizer_path": "/elsewhere", "targets": ["q", "v"]}
    assert diff_meta({**META, "targets": ("q", "v")}, saved) == []
    assert diff_meta({**META, "tokenizer_sha256": "tok-2"}, saved) == ["targets", "tokenizer_sha256"]


def _data_files(step_dir: Path) -> list[Path]:
    """The array data files of a saved step, largest first."""
    files = [p for p in (step_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d"]
    return sorted(files, key=lambda p: p.stat().st_size, reverse=True)


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flip_bytes(path: Path, n: int = 400) -> None:
    data = bytearray(path.read_bytes())
    start = len(data) // 3
    for i in range(start, min(start + n, len(data))):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def _empty_folder(step_dir: Path) -> None:
    shutil.rmtree(step_dir)
    step_dir.mkdir()


DAMAGE = {
    "truncated data file": lambda d: _truncate(_data_files(d)[0]),
    "deleted data file": lambda d: _data_files(d)[0].unlink(),
    "flipped bytes in a data file": lambda d: _flip_bytes(_data_files(d)[0]),
    "deleted manifest": lambda d: (d / "state" / "manifest.ocdbt").unlink(),
    "deleted metadata": lambda d: (d / "state" / "_METADATA").unlink(),
    "empty metadata": lambda d: (d / "state" / "_METADATA").write_bytes(b""),
    "deleted meta record": lambda d: (d / "meta" / "metadata").unlink(),
    "empty step folder": _empty_folder,
}


def _save_steps(directory: Path, steps: tuple[int, ...], meta: dict = META) -> dict[int, TrainState]:
    template = make_state("scratch")
    states = {step: perturbed(template, step) for step in steps}
    ckpt = Checkpointer(directory, keep=len(steps))
    for state in states.values():
        assert ckpt.save(state, meta)
    ckpt.close()
    return states


def _damage_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name.startswith("needle") and r.levelno >= logging.WARNING]


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_a_damaged_newest_checkpoint_falls_back_to_the_newest_good_one(
    tmp_path: Path, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    states = _save_steps(tmp_path / "ckpt", (2, 4))
    assert json.loads((tmp_path / "ckpt" / "4" / CHECKSUM_FILE).read_text())["files"]
    DAMAGE[kind](tmp_path / "ckpt" / "4")
    ckpt = Checkpointer(tmp_path / "ckpt")
    with caplog.at_level(logging.INFO):
        restored, meta = ckpt.restore_latest(make_state("scratch"), META)
    assert meta["step"] == 2 and int(restored.step) == 2
    assert_trees_equal(restored.trainable, states[2].trainable)
    warnings = _damage_records(caplog)
    if (tmp_path / "ckpt.damaged").exists():  # orbax still listed step 4: it was tried and set aside
        assert len(warnings) == 1 and "step 4" in warnings[0].getMessage() and "\n" not in warnings[0].getMessage()
        assert "falling back to step 2" in warnings[0].getMessage()
        assert [p.name.split("-")[0] for p in (tmp_path / "ckpt.damaged").iterdir()] == ["4"]
    # Out of the way: the resumed run can write step 4 again.
    assert ckpt.all_steps() == [2]
    assert ckpt.save(states[4], META)
    ckpt.close()
    assert Checkpointer(tmp_path / "ckpt").restore_latest(make_state("scratch"), META)[1]["step"] == 4


def test_a_checkpoint_holding_nan_is_skipped(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # As an older needle could write: the newest checkpoint's params are NaN.
    states = _save_steps(tmp_path, (2,))
    bad = states[2].replace(
        step=jnp.asarray(4, jnp.int32), trainable=jax.tree.map(lambda x: x * jnp.nan, states[2].trainable)
    )
    ckpt = Checkpointer(tmp_path, keep=3)
    ckpt.save(bad, META)
    ckpt.wait()
    with caplog.at_level(logging.WARNING):
        _, meta = ckpt.restore_latest(make_state("scratch"), META)
    ckpt.close()
    assert meta["step"] == 2
    (warning,) = _damage_records(caplog)
    assert "NaN or infinite" in warning.getMessage()


def test_every_checkpoint_damaged_is_one_clean_error(tmp_path: Path) -> None:
    _save_steps(tmp_path, (2, 4))
    _flip_bytes(_data_files(tmp_path / "4")[0])
    (tmp_path / "2" / "state" / "manifest.ocdbt").unlink()
    ckpt = Checkpointer(tmp_path)
    with pytest.raises(CheckpointDamagedError) as err:
        ckpt.restore_latest(make_state("scratch"), META)
    ckpt.close()
    message = str(err.value)
    assert "no usable checkpoint" in message and "step 4:" in message and "step 2:" in message
    assert "\n" not in message and len(message) < 1500
    assert err.value.__cause__ is None and err.value.__context__ is None
    assert isinstance(err.value, NeedleError)
    # Nothing was moved: the operator decides.
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.isdigit()) == ["2", "4"]


def test_orbax_step_metadata_is_not_content(tmp_path: Path) -> None:
    # _CHECKPOINT_METADATA holds timestamps only: without it the verified data still restores.
    states = _save_steps(tmp_path, (2, 4))
    (tmp_path / "4" / "_CHECKPOINT_METADATA").unlink()
    ckpt = Checkpointer(tmp_path)
    restored, meta = ckpt.restore_latest(make_state("scratch"), META)
    ckpt.close()
    assert meta["step"] == 4
    assert_trees_equal(restored.trainable, states[4].trainable)


def test_a_checkpoint_without_checksums_is_restored_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    states = _save_steps(tmp_path, (3,))
    (tmp_path / "3" / CHECKSUM_FILE).unlink()  # as written before checksums were recorded
    ckpt = Checkpointer(tmp_path)
    with caplog.at_level(logging.WARNING):
        restored, meta = ckpt.restore_latest(make_state("scratch"), META)
    ckpt.close()
    assert meta["step"] == 3
    assert_trees_equal(restored.trainable, states[3].trainable)
    (warning,) = _damage_records(caplog)
    assert "unverified" in warning.getMessage()


def test_checksums_name_the_changed_or_missing_file(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x.bin").write_bytes(b"abc")
    write_checksums(tmp_path)
    assert verify_checksums(tmp_path)
    (tmp_path / "a" / "x.bin").write_bytes(b"abd")
    with pytest.raises(CheckpointDamagedError, match="a/x.bin does not match"):
        verify_checksums(tmp_path)
    (tmp_path / "a" / "x.bin").unlink()
    with pytest.raises(CheckpointDamagedError, match="a/x.bin is missing"):
        verify_checksums(tmp_path)
