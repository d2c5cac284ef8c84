"""Transformer forward pass: shapes, causality, GQA semantics, KV-cache decoding, dtypes."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from needle.hardware import settings_for
from needle.model.decoder.transformer import Transformer, init_cache


def test_forward_shapes_names_and_finite(cfg, base_params, make_tokens, logits_of):
    tokens = make_tokens((2, 12))
    logits = logits_of(Transformer(cfg), base_params, tokens)
    assert logits.shape == (2, 12, cfg.vocab_size) and logits.dtype == jnp.float32
    assert bool(jnp.all(jnp.isfinite(logits)))
    top = set(base_params)
    assert top == {"embed", "final_norm"} | {f"block_{i}" for i in range(cfg.n_layers)}
    names = {"/".join(k[1:]) for k in traverse_util.flatten_dict(base_params) if k[0] == "block_0"}
    projs = ["attn/q_proj", "attn/k_proj", "attn/v_proj", "attn/o_proj", "mlp/gate_proj", "mlp/up_proj"]
    assert names == {f"{p}/kernel" for p in projs + ["mlp/down_proj"]} | {"attn_norm/scale", "mlp_norm/scale"}


def test_untied_head_equal_to_embedding_matches_tied(cfg, base_params, make_tokens, logits_of):
    untied = cfg.model_copy(update={"tie_embeddings": False})
    shapes = jax.eval_shape(lambda: Transformer(untied).init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32)))
    assert shapes["params"]["lm_head"]["kernel"].shape == (cfg.d_model, cfg.vocab_size)
    params = {**base_params, "lm_head": {"kernel": base_params["embed"]["embedding"].T}}
    tokens = make_tokens((1, 6))
    np.testing.assert_allclose(
        np.asarray(logits_of(Transformer(untied), params, tokens)),
        np.asarray(logits_of(Transformer(cfg), base_params, tokens)),
        atol=1e-5,
    )


def test_causality(cfg, base_params, make_tokens, logits_of):
    model = Transformer(cfg)
    tokens = make_tokens((2, 10))
    changed = tokens.at[:, 6].set((tokens[:, 6] + 1) % cfg.vocab_size)
    a = logits_of(model, base_params, tokens)
    b = logits_of(model, base_params, changed)
    np.testing.assert_array_equal(np.asarray(a[:, :6]), np.asarray(b[:, :6]))
    assert float(jnp.max(jnp.abs(a[:, 6:] - b[:, 6:]))) > 1e-3


def test_gqa_equals_mha_with_repeated_kv_heads(cfg, base_params, make_tokens, logits_of):
    """Query head n reads kv head n // (n_heads / n_kv_heads): same as MHA with copied kv heads."""
    assert cfg.n_kv_heads < cfg.n_heads
    mha_cfg = cfg.model_copy(update={"n_kv_heads": cfg.n_heads})
    group = cfg.n_heads // cfg.n_kv_heads
    flat = traverse_util.flatten_dict(base_params)
    for key in list(flat):
        if key[-2] in ("k_proj", "v_proj"):
            w = flat[key].reshape(cfg.d_model, cfg.n_kv_heads, cfg.head_dim)
            flat[key] = jnp.repeat(w, group, axis=1).reshape(cfg.d_model, cfg.n_heads * cfg.head_dim)
    tokens = make_tokens((2, 9))
    gqa = logits_of(Transformer(cfg), base_params, tokens)
    mha = logits_of(Transformer(mha_cfg), traverse_util.unflatten_dict(flat), tokens)
    np.testing.assert_allclose(np.asarray(gqa), np.asarray(mha), atol=1e-5)


def test_cached_decoding_matches_full_forward(cfg, base_params, make_tokens, logits_of):
    model = Transformer(cfg)
    lengths, bucket, steps, max_len = [3, 8, 5], 8, 6, 16
    full_tokens = make_tokens((3, max_len), seed=1)
    full = logits_of(model, base_params, full_tokens)

    # Ragged prompts, right-padded with garbage that must never leak into later logits.
    prompts = np.array(full_tokens[:, :bucket])
    for row, n in enumerate(lengths):
        prompts[row, n:] = 7

    def step(cache: dict, tokens: jax.Array, positions: jax.Array) -> tuple[jax.Array, dict]:
        variables = {"params": base_params, "cache": cache}
        return model.apply(variables, tokens, positions, decode=True, mutable=["cache"])

    apply = jax.jit(step)
    cache = init_cache(model, 3, max_len)
    positions = jnp.broadcast_to(jnp.arange(bucket, dtype=jnp.int32), (3, bucket))
    logits, upd = apply(cache, jnp.asarray(prompts), positions)
    rows = np.arange(3)
    last = np.array(lengths) - 1
    np.testing.assert_allclose(np.asarray(logits[rows, last]), np.asarray(full[rows, last]), atol=1e-4)

    cache = upd["cache"]
    for i in range(steps):
        pos = np.array(lengths) + i
        step_tokens = full_tokens[rows, pos][:, None]
        logits, upd = apply(cache, step_tokens, jnp.asarray(pos[:, None], jnp.int32))
        cache = upd["cache"]
        np.testing.assert_allclose(np.asarray(logits[:, 0]), np.asarray(full[rows, pos]), atol=1e-4)


def test_init_cache_matches_model_init_layout(cfg):
    model = Transformer(cfg)
    cache = init_cache(model, 2, 16)
    via_init = jax.eval_shape(lambda: model.init(jax.random.key(1), jnp.zeros((2, 16), jnp.int32), decode=True))
    assert jax.tree.structure(cache) == jax.tree.structure(via_init["cache"])
    assert set(cache) == {f"block_{i}" for i in range(cfg.n_layers)}
    for leaf in jax.tree.leaves(cache):
        assert leaf.shape == (2, 16, cfg.n_kv_heads, cfg.head_dim)
        assert not np.any(np.asarray(leaf))


def test_init_cache_traces_the_model_once_per_size(cfg):
    from needle.model.decoder import transformer

    transformer._trace_cache_shapes.cache_clear()
    first = init_cache(Transformer(cfg), 2, 16)
    again = init_cache(Transformer(cfg), 2, 16)  # an equal model: the same shapes, not traced again
    info = transformer._trace_cache_shapes.cache_info()
    assert (info.hits, info.misses) == (1, 1)
    assert jax.tree.structure(again) == jax.tree.structure(first)
    # what is kept between calls is shapes only, never arrays a caller could hold on to
    assert all(isinstance(s, jax.ShapeDtypeStruct) for s in jax.tree.leaves(transformer._trace_cache_shapes(Transformer(cfg), 2, 16)))
    other = init_cache(Transformer(cfg), 3, 16)
    assert transformer._trace_cache_shapes.cache_info().misses == 2
    assert jax.tree.leaves(other)[0].shape[0] == 3


def test_bfloat16_compute_is_finite_and_close(cfg, base_params, make_tokens, logits_of):
    tokens = make_tokens((2, 16))
    ref = logits_of(Transformer(cfg), base_params, tokens)
    gpu = settings_for("gpu")
    assert gpu.compute_dtype == "bfloat16"
    out = logits_of(Transformer(cfg, settings=gpu), base_params, tokens)
    assert out.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(out)))
    err = float(jnp.max(jnp.abs(out - ref)))
    assert 0 < err < 0.1 * float(jnp.max(jnp.abs(ref))), err


def test_remat_gives_same_logits(cfg, base_params, make_tokens, logits_of):
    tokens = make_tokens((1, 8))
    cpu = dataclasses.replace(settings_for("cpu"), remat="none")
    ref = logits_of(Transformer(cfg, settings=cpu), base_params, tokens)
    for policy in ("everything", "dots_saveable", "dots_with_no_batch_dims_saveable", "projections_saveable", "mlp_saveable"):
        remat = logits_of(Transformer(cfg, settings=dataclasses.replace(cpu, remat=policy)), base_params, tokens)
        np.testing.assert_allclose(np.asarray(remat), np.asarray(ref), atol=1e-6)
    with pytest.raises(ValueError, match="remat policy"):
        dataclasses.replace(cpu, remat="sometimes")


@pytest.mark.parametrize("family", ["needle", "gemma3_text"])
def test_packed_rows_give_the_logits_of_each_row_alone(cfg, make_tokens, family):
    """segment_ids + positions restarting per row: each packed row's logits equal its own forward.

    The Gemma-style config covers the sliding window (shorter than a row), q/k norms, both
    RoPE bases and both soft caps."""
    if family == "gemma3_text":
        cfg = cfg.model_copy(update=dict(
            arch="gemma3_text", qk_norm=True, norm_offset_one=True, post_norms=True, embed_scale=True,
            mlp_act="gelu_tanh", rope_local_theta=10000.0, rope_theta=1e6, sliding_window=5,
            layer_types=("sliding_attention", "full_attention"), attn_softcap=50.0, final_softcap=30.0,
        ))  # fmt: skip
    model = Transformer(cfg)
    params = model.init(jax.random.key(1), jnp.zeros((1, 8), jnp.int32))["params"]
    lengths = [(7, 9, 4), (12, 6)]  # two sequences of 24 slots, the second with padding
    t = 24
    tokens = make_tokens((2, t), seed=3)
    positions = np.zeros((2, t), np.int32)
    segments = np.zeros((2, t), np.int32)
    for r, lens in enumerate(lengths):
        at = 0
        for s, n in enumerate(lens, start=1):
            positions[r, at : at + n], segments[r, at : at + n] = np.arange(n), s
            at += n
    packed = jax.jit(model.apply)({"params": params}, tokens, jnp.asarray(positions), segment_ids=jnp.asarray(segments))
    for r, lens in enumerate(lengths):
        at = 0
        for n in lens:
            alone = model.apply({"params": params}, tokens[r : r + 1, at : at + n])
            np.testing.assert_allclose(np.asarray(packed[r, at : at + n]), np.asarray(alone[0]), atol=2e-5, rtol=1e-5)
            at += n
    with pytest.raises(ValueError, match="segment_ids"):
        model.apply({"params": params}, tokens, segment_ids=jnp.asarray(segments[:, :5]))


def test_sample_model_shapes():
    """``needle sample-model --shape``: the presets are the real models' sizes; keys parse."""
    from needle.model.hf.config import hf_config_to_model_config
    from needle.model.hf.random_model import parse_shape, shape_config

    sizes = {"smollm2-135m": 134.5, "qwen3-0.6b": 596.0, "gemma3-270m": 268.1}
    for name, millions in sizes.items():
        cfg = hf_config_to_model_config(shape_config(name), max_len=64)
        shapes = jax.eval_shape(lambda: Transformer(cfg).init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32)))
        assert abs(sum(x.size for x in jax.tree.leaves(shapes)) / 1e6 - millions) < 0.1, name
    assert parse_shape("hidden_size=96,num_hidden_layers=3,hidden_act=silu") == {
        "hidden_size": 96, "num_hidden_layers": 3, "hidden_act": "silu"}
    cfg = hf_config_to_model_config(shape_config("hidden_size=96,num_hidden_layers=3", "gemma3_text", 512))
    assert (cfg.d_model, cfg.n_layers, len(cfg.resolved_layer_types()), cfg.vocab_size) == (96, 3, 3, 512)
    with pytest.raises(ValueError, match="key=value"):
        parse_shape("hidden_size")
