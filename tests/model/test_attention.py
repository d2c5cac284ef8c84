"""Blocked attention (needle/model/decoder/attention.py) equals the dense path: causal, GQA, packing's
segment ids, sliding windows, the soft cap; and the model's blocked/dense paths agree."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from needle.hardware import settings_for
from needle.model.decoder.attention import blocked_attention
from needle.model.decoder.attention import softcapped_attention
from needle.model.decoder.transformer import Transformer


def _qkv(b=2, t=23, h=4, kv=2, hd=8, seed=0):
    ks = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(ks[0], (b, t, h, hd)), jax.random.normal(ks[1], (b, t, kv, hd)),
            jax.random.normal(ks[2], (b, t, kv, hd)))  # fmt: skip


def _segments(b, t):
    # Row 0: three packed rows then padding (segment 0); row 1: one row filling the sequence.
    seg = np.zeros((b, t), np.int32)
    seg[0, :7], seg[0, 7:15], seg[0, 15:20] = 1, 2, 3
    seg[1, :] = 1
    return jnp.asarray(seg)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("softcap", [None, 20.0])
@pytest.mark.parametrize("packed", [False, True])
def test_blocked_equals_dense(window, softcap, packed):
    q, k, v = _qkv()
    seg = _segments(2, 23) if packed else None
    seg_mask = None if seg is None else seg[:, None, :, None] == seg[:, None, None, :]
    # The dense reference: attention.py's spelled-out softmax (it handles every option).
    ref = softcapped_attention(q, k, v, None, window, 0.3, softcap if softcap else 1e9, seg_mask)
    for block in (4, 8, 64):
        out = blocked_attention(q, k, v, scale=0.3, window=window, softcap=softcap if softcap else 1e9,
                                segment_ids=seg, block=block)  # fmt: skip
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5)
    if softcap is None:  # and jax's own attention (what attention="dense" runs without a cap)
        local = None if window is None else (window - 1, 0)
        nn_ref = jax.nn.dot_product_attention(q, k, v, mask=seg_mask, scale=0.3, is_causal=True,
                                              local_window_size=local)  # fmt: skip
        out = blocked_attention(q, k, v, scale=0.3, window=window, segment_ids=seg, block=8)
        np.testing.assert_allclose(np.asarray(out), np.asarray(nn_ref), atol=1e-5)


@pytest.mark.parametrize("block", [5, 16])  # packed rows in tiles (over two blocks), and in query blocks
def test_blocked_gradient_equals_dense(block):
    q, k, v = _qkv(t=17)
    seg = _segments(2, 17)
    seg_mask = seg[:, None, :, None] == seg[:, None, None, :]
    dense = lambda q, k, v: jnp.sum(jnp.sin(softcapped_attention(q, k, v, None, 6, None, 30.0, seg_mask)))  # noqa: E731
    blocked = lambda q, k, v: jnp.sum(jnp.sin(blocked_attention(q, k, v, window=6, softcap=30.0, segment_ids=seg, block=block)))  # noqa: E731
    for a, b in zip(jax.grad(dense, (0, 1, 2))(q, k, v), jax.grad(blocked, (0, 1, 2))(q, k, v)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5)


def _long_rows(b, t, seed=0):
    """Every batch row packs rows of 5-17 tokens (then padding), so later query blocks skip keys."""
    rng = np.random.default_rng(seed)
    seg = np.zeros((b, t), np.int32)
    for r in range(b):
        at, sid = int(rng.integers(0, 4)), 1
        while at < t - 3:
            n = int(rng.integers(5, 18))
            seg[r, at : at + n] = sid
            at, sid = at + n, sid + 1
    return jnp.asarray(seg)


@pytest.mark.parametrize("window", [None, 9])
def test_blocked_skips_keys_of_earlier_rows_exactly(window):
    """Packed rows in every batch row: query tiles start their keys at their first row's tile;
    output and gradient equal the dense path's."""
    t = 61
    q, k, v = _qkv(t=t, seed=4)
    seg = _long_rows(2, t)
    seg_mask = seg[:, None, :, None] == seg[:, None, None, :]
    dense = lambda q, k, v: softcapped_attention(q, k, v, None, window, None, 1e9, seg_mask)  # noqa: E731
    for block in (4, 8):
        blocked = lambda q, k, v: blocked_attention(q, k, v, window=window, segment_ids=seg, block=block)  # noqa: E731
        np.testing.assert_allclose(np.asarray(jax.jit(blocked)(q, k, v)), np.asarray(dense(q, k, v)), atol=1e-5)
        loss = lambda f: lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v)))  # noqa: E731
        want = jax.grad(loss(dense), (0, 1, 2))(q, k, v)
        got = jax.jit(jax.grad(loss(blocked), (0, 1, 2)))(q, k, v)
        for a, b in zip(want, got):
            np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5)


def test_blocked_packed_rows_never_read_earlier_rows_keys():
    """A key block wholly before every batch row's current row is not read: NaN keys there do not
    reach the output (without the skip, 0 x NaN would)."""
    t, block = 32, 8
    q, k, v = _qkv(t=t, seed=5)
    seg = np.ones((2, t), np.int32)
    seg[:, 16:] = 2  # rows [0, 16) and [16, 32) in both batch rows
    poisoned = v.at[:, :8].set(jnp.nan)
    out = np.asarray(jax.jit(lambda v: blocked_attention(q, k, v, segment_ids=jnp.asarray(seg), block=block))(poisoned))
    assert np.isnan(out[:, :8]).all() and np.isfinite(out[:, 16:]).all()


def _gemma(cfg):
    return cfg.model_copy(update=dict(
        arch="gemma3_text", qk_norm=True, norm_offset_one=True, post_norms=True, embed_scale=True,
        mlp_act="gelu_tanh", rope_local_theta=10000.0, rope_theta=1e6, sliding_window=5,
        layer_types=("sliding_attention", "full_attention"), attn_softcap=50.0, final_softcap=30.0,
        query_pre_attn_scalar=16.0,
    ))  # fmt: skip


@pytest.mark.parametrize("family", ["needle", "gemma3_text"])
def test_model_blocked_equals_dense_packed_and_prefill(cfg, make_tokens, family):
    """The model's attention="blocked" forward (packed rows) and cached prefill equal "dense"."""
    from needle.model.lora import init_params
    from needle.model.decoder.transformer import init_cache

    cfg = _gemma(cfg) if family == "gemma3_text" else cfg
    params = init_params(cfg, None, jax.random.key(1))
    cpu = settings_for("cpu")
    dense = Transformer(cfg, settings=dataclasses.replace(cpu, attention="dense"))
    blocked = Transformer(cfg, settings=dataclasses.replace(cpu, attention="blocked"))
    tokens = make_tokens((2, 23), seed=3)
    seg = _segments(2, 23)
    pos = jnp.asarray(np.concatenate([[np.r_[0:7, 0:8, 0:5, 0:3]], [np.arange(23)]]), jnp.int32)
    a = jax.jit(dense.apply)({"params": params}, tokens, pos, segment_ids=seg)
    b = jax.jit(blocked.apply)({"params": params}, tokens, pos, segment_ids=seg)
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5)
    cache = init_cache(dense, 2, 32)
    fill = lambda m: m.apply({"params": params, "cache": cache}, tokens, None, decode=True, mutable=["cache"])  # noqa: E731
    (la, ca), (lb, cb) = jax.jit(fill, static_argnums=0)(dense), jax.jit(fill, static_argnums=0)(blocked)
    np.testing.assert_allclose(np.asarray(lb), np.asarray(la), atol=1e-5)
    for x, y in zip(jax.tree.leaves(ca), jax.tree.leaves(cb)):
        np.testing.assert_allclose(np.asarray(y), np.asarray(x), atol=1e-5)


def test_tiled_program_does_not_grow_with_sequence_length():
    """Packed attention loops over tiles (lax loops): 8x the tiles, the same program size."""
    from needle.model.decoder.tiled import tiled_attention

    def hlo_ops(t):
        q, k, v = _qkv(b=1, t=t)
        seg = jnp.asarray(np.arange(t) // 10 + 1, jnp.int32)[None]
        grad = jax.grad(lambda q, k, v: jnp.sum(tiled_attention(q, k, v, seg, block=8)), (0, 1, 2))
        return jax.jit(grad).lower(q, k, v).as_text().count("\n")

    assert hlo_ops(8 * 64) <= hlo_ops(64) * 1.05


def test_projections_saveable_keeps_the_tiled_output_and_recomputes_no_tile(capsys):
    """Under remat "projections_saveable" the tiled attention's output and log-sum-exp are kept
    by name, so the backward pass runs no forward tile again, and the gradients are unchanged."""
    from jax.ad_checkpoint import print_saved_residuals

    from needle.model.decoder.scan import lookup_checkpoint_policy
    from needle.model.decoder.tiled import tiled_attention

    q, k, v = _qkv(b=1, t=64)
    seg = jnp.asarray(np.arange(64) // 10 + 1, jnp.int32)[None]

    def loss(q, k, v):
        return jnp.sum(jnp.sin(tiled_attention(q, k, v, seg, block=16)))

    kept = jax.checkpoint(loss, policy=lookup_checkpoint_policy("projections_saveable"))
    print_saved_residuals(kept, q, k, v)
    names = [ln.split("named ")[1].split(" ")[0] for ln in capsys.readouterr().out.splitlines() if "named" in ln]
    assert sorted(names) == ["'attn_lse'", "'attn_out'"]
    # The forward tiles' running max: once in the gradient's program (the forward), where plain
    # remat runs those tiles twice.
    def running_maxes(f):
        return len(re.findall(r"= max ", str(jax.make_jaxpr(jax.grad(f, (0, 1, 2)))(q, k, v))))

    assert (running_maxes(kept), running_maxes(jax.checkpoint(loss))) == (1, 2)
    for a, b in zip(jax.grad(kept, (0, 1, 2))(q, k, v), jax.grad(loss, (0, 1, 2))(q, k, v)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
