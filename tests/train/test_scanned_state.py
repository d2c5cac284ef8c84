"""A scanned model's train state keeps its blocks stacked (needle/model/decoder/scan.py stack_layers):
the layout converts exactly, checkpoints keep the block_i layout and resume exactly, and the
export equals the unrolled run's."""

from __future__ import annotations

import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file
from test_run import assert_same_params, flat_params
from train_helpers import LORA, finetune_configs, tiny_prepared, tiny_tokenizer

from needle.hardware import settings_for, with_overrides
from needle.model.decoder.scan import LAYERS, cast_matrices, map_param_trees, stack_layers, unstack_layers
from needle.train.run import build_state, run_training


def _blocks(n: int) -> dict:
    return {
        "embed": {"embedding": jnp.ones((8, 4))},
        **{f"block_{i}": {"attn": {"kernel": jnp.full((4, 3), float(i))}, "norm": {"scale": jnp.full((4,), float(i))}}
           for i in range(n)},
    }  # fmt: skip


@pytest.mark.parametrize("period", [1, 2])
def test_stack_and_unstack_are_inverse(period: int) -> None:
    params = _blocks(6)
    stacked = stack_layers(params, period)
    assert set(stacked) == {"embed", LAYERS} and set(stacked[LAYERS]) == {str(j) for j in range(period)}
    # Block g * period + j sits at index g of layers/<j>.
    kernel = stacked[LAYERS][str(period - 1)]["attn"]["kernel"]
    assert kernel.shape == (6 // period, 4, 3)
    assert [float(kernel[g, 0, 0]) for g in range(6 // period)] == [float(g * period + period - 1) for g in range(6 // period)]
    back = unstack_layers(stacked)
    assert jax.tree.structure(back) == jax.tree.structure(params)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params)))
    assert stack_layers({"embed": params["embed"]}, period) == {"embed": params["embed"]}  # no blocks: unchanged
    with pytest.raises(ValueError, match="do not divide"):
        stack_layers(_blocks(5), 2)


def test_cast_matrices_knows_stacked_vectors_from_matrices() -> None:
    cast = cast_matrices(stack_layers(_blocks(2), 1), jnp.bfloat16)
    assert cast["embed"]["embedding"].dtype == jnp.bfloat16
    assert cast[LAYERS]["0"]["attn"]["kernel"].dtype == jnp.bfloat16
    assert cast[LAYERS]["0"]["norm"]["scale"].dtype == jnp.float32  # [L, D]: a stacked vector
    moments = {"mu": _blocks(2), "count": jnp.int32(3)}
    mapped = map_param_trees(lambda t: stack_layers(t, 1), moments, _blocks(2))
    assert LAYERS in mapped["mu"] and mapped["count"] == 3


@pytest.mark.slow
def test_scanned_lora_run_resumes_exactly_and_exports_as_unrolled(tmp_path: Path) -> None:
    prepared, tok = tiny_prepared(), tiny_tokenizer()
    model_cfg, scratch, optim = finetune_configs("scratch", steps=2)
    base = run_training(prepared, tok, model_cfg, scratch, optim, out_dir=tmp_path / "base").model_dir
    runs = {}
    for scan in (True, False):
        _, train, optim = finetune_configs("lora", steps=4, scan_layers=scan)
        runs[scan] = run_training(prepared, tok, model_cfg, train, optim, LORA, base_model_dir=base,
                                  out_dir=tmp_path / f"scan-{scan}")  # fmt: skip
    _, train, optim = finetune_configs("lora", steps=4, scan_layers=True)
    state, master = build_state(model_cfg, train, optim, LORA, base, with_overrides(settings_for("cpu"), train),
                                keep_master=True)  # fmt: skip
    assert master is None  # the CPU computes in float32: no cast, no second copy
    assert LAYERS in state.trainable and not any(k.startswith("block_") for k in state.trainable)
    assert len(jax.tree.leaves(state.trainable)) == 2 * len(LORA.targets)  # one leaf per kind, not per layer

    scanned, unrolled = tmp_path / "scan-True", tmp_path / "scan-False"
    assert_same_params(flat_params(unrolled / "model"), flat_params(scanned / "model"), atol=1e-5)
    # The unmerged adapter file: block_i names and values as the unrolled run writes them.
    adapters = [load_file(d / "model" / "adapter.safetensors") for d in (scanned, unrolled)]
    assert adapters[0].keys() == adapters[1].keys() and any("block_1" in k for k in adapters[0])
    for name in adapters[0]:
        np.testing.assert_allclose(adapters[0][name], adapters[1][name], atol=1e-5, err_msg=name)

    # Resume from step 2's checkpoint (block_i layout on disk, stacked again in the state): exact.
    first = flat_params(scanned / "model")
    shutil.rmtree(scanned / "checkpoints" / "4")
    shutil.rmtree(scanned / "model")
    again = run_training(prepared, tok, model_cfg, train, optim, LORA, base_model_dir=base, out_dir=scanned)
    assert [r["step"] for r in again.history] == [3, 4]
    assert_same_params(first, flat_params(scanned / "model"), atol=0)


@pytest.mark.slow
def test_accelerator_settings_export_merges_onto_the_float32_base(tmp_path: Path) -> None:
    """The TPU's settings on this CPU: scanned, stacked state, a bfloat16 frozen base. The export
    folds the adapters into the float32 master copy, so what has no adapter is the base exactly."""
    prepared, tok = tiny_prepared(), tiny_tokenizer()
    model_cfg, scratch, optim = finetune_configs("scratch", steps=2)
    base = run_training(prepared, tok, model_cfg, scratch, optim, out_dir=tmp_path / "base").model_dir
    _, train, optim = finetune_configs("lora", steps=2)
    tuned = run_training(prepared, tok, model_cfg, train, optim, LORA, base_model_dir=base, out_dir=tmp_path / "tpu",
                         settings=settings_for("tpu"))  # fmt: skip
    base_p, tuned_p = flat_params(Path(base)), flat_params(Path(tuned.model_dir))
    assert base_p.keys() == tuned_p.keys() and all(v.dtype == np.float32 for v in tuned_p.values())
    untouched = [k for k in base_p if "embed" in k or "scale" in k]
    assert untouched and all(np.array_equal(base_p[k], tuned_p[k]) for k in untouched)
    assert any(not np.array_equal(base_p[k], tuned_p[k]) for k in base_p if "kernel" in k)


def test_accelerator_state_holds_a_bfloat16_base_and_a_float32_master_on_the_host() -> None:
    """build_state_from_params under a TPU's settings: the frozen base cast before it is stacked
    (matrices bfloat16, norm scales float32), adapters float32, and the export's master copy of the
    base as host arrays in the state's stacked layout, equal to the float32 params."""
    from needle.config import OptimConfig, model_preset
    from needle.model.decoder.transformer import Transformer
    from needle.model.lora import init_params, split_trainable
    from needle.train.run import build_state_from_params

    cfg = model_preset("tiny")
    settings = settings_for("tpu", cfg.n_layers)
    assert settings.scan_layers and settings.compute_dtype == "bfloat16"
    params = init_params(cfg, LORA, jax.random.key(0))
    expected = stack_layers(jax.tree.map(np.asarray, split_trainable(params, "lora")[1]), 1)
    state, master = build_state_from_params(params, Transformer(cfg, LORA, settings), "lora", OptimConfig(), 4,
                                            keep_master=True)  # fmt: skip
    assert LAYERS in state.frozen and LAYERS in state.trainable
    frozen = jax.tree_util.tree_flatten_with_path(state.frozen)[0]
    for path, leaf in frozen:
        matrix = leaf.ndim >= 2 + any(getattr(k, "key", None) == LAYERS for k in path)
        assert leaf.dtype == (jnp.bfloat16 if matrix else jnp.float32), path
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(state.trainable))
    assert jax.tree.structure(master) == jax.tree.structure(state.frozen)
    for got, want in zip(jax.tree.leaves(master), jax.tree.leaves(expected)):
        assert isinstance(got, np.ndarray) and got.dtype == np.float32
        np.testing.assert_array_equal(got, want)
    _, none = build_state_from_params(init_params(cfg, LORA, jax.random.key(0)), Transformer(cfg, LORA, settings),
                                      "lora", OptimConfig(), 4)  # fmt: skip
    assert none is None  # no master unless asked
