"""needle's flash kernel (needle/model/decoder/flash.py) equals blocked attention, forward and gradients.

The Pallas kernels run under ``interpret=True`` (CI has no TPU): the same kernel code, the tile
table's skipping and masks included. ``block=128`` with T 256-512, so rows cross tile edges and
tile pairs of every kind (skipped, unmasked, masked) occur."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from needle.model.decoder.attention import blocked_attention
from needle.model.decoder.flash import FULL, MASKED, SKIP, flash_attention, flash_supported, tile_table
from needle.model.decoder.scan import lookup_checkpoint_policy

F32_ATOL = 2e-5  # the online softmax against the exact one: rounding only (as tests/model/test_splash.py)


def _normal(shape, seed=0, dtype=jnp.float32):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, np.float32), dtype)


def _qkv(b=2, t=384, h=6, kv=2, hd=64, seed=0, dtype=jnp.float32):
    return tuple(_normal((b, t, n, hd), seed * 3 + i, dtype) for i, n in enumerate((h, kv, kv)))


def _segments(t=384):
    # Row 0: packed rows of 100, 200 (crossing two tile edges) and the rest, then 40 of padding (0);
    # row 1: one id used twice with another between (not contiguous: the kernel must not assume runs).
    seg = np.zeros((2, t), np.int32)
    seg[0, :100], seg[0, 100:300], seg[0, 300 : t - 40] = 1, 2, 3
    seg[1, :150], seg[1, 150:260], seg[1, 260:] = 5, 6, 5
    return jnp.asarray(seg)


@functools.cache
def _fn(name, block=128):
    if name == "flash":
        return jax.jit(functools.partial(flash_attention, block=block, interpret=True))
    return jax.jit(lambda q, k, v, s: blocked_attention(q, k, v, segment_ids=s))


def _out_and_grads(name, q, k, v, seg, w):
    def both(q, k, v, w):
        out, vjp = jax.vjp(lambda q, k, v: _fn(name)(q, k, v, seg), q, k, v)
        return out, vjp(w)

    return jax.jit(both)(q, k, v, w)


def _close(a, b, atol):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=atol, rtol=0)


def test_tile_table_kinds():
    table = np.asarray(tile_table(_segments(), 128))
    # Row 0, tiles [0,128) [128,256) [256,384): segments {1,2} {2} {2,3,0}.
    assert table[0].tolist() == [[MASKED, SKIP, SKIP], [MASKED, MASKED, SKIP], [MASKED, MASKED, MASKED]]
    # Row 1: {5} {5,6} {6,5}: tile 2 meets tile 0 through id 5 although 6 lies between.
    assert table[1].tolist() == [[MASKED, SKIP, SKIP], [MASKED, MASKED, SKIP], [MASKED, MASKED, MASKED]]
    one = np.asarray(tile_table(jnp.ones((1, 384), jnp.int32), 128))[0]
    assert one.tolist() == [[MASKED, SKIP, SKIP], [FULL, MASKED, SKIP], [FULL, FULL, MASKED]]
    apart = np.asarray(tile_table(jnp.repeat(jnp.arange(1, 4, dtype=jnp.int32), 128)[None], 128))[0]
    assert (np.tril(apart, -1) == SKIP).all() and (np.diag(apart) == MASKED).all()


@pytest.mark.parametrize("kv", [2, 1, 6])  # grouped-query, multi-query, plain multi-head
def test_packed_rows_equal_blocked_with_gradients(kv):
    q, k, v = _qkv(kv=kv)
    seg = _segments()
    w = _normal(q.shape, seed=7)
    out, grads = _out_and_grads("flash", q, k, v, seg, w)
    ref, ref_grads = _out_and_grads("blocked", q, k, v, seg, w)
    assert out.shape == q.shape and out.dtype == q.dtype
    _close(out, ref, F32_ATOL)
    for g, r in zip(grads, ref_grads):
        _close(g, r, 5 * F32_ATOL)


def test_one_row_per_sequence_uses_unmasked_tiles_and_equals_blocked():
    q, k, v = _qkv(b=1, t=384, seed=2)
    seg = jnp.ones((1, 384), jnp.int32)
    w = _normal(q.shape, seed=8)
    out, grads = _out_and_grads("flash", q, k, v, seg, w)
    ref, ref_grads = _out_and_grads("blocked", q, k, v, seg, w)
    _close(out, ref, F32_ATOL)
    for g, r in zip(grads, ref_grads):
        _close(g, r, 5 * F32_ATOL)


def test_bfloat16_and_scale():
    q, k, v = _qkv(b=1, t=256, h=2, kv=1, hd=32, seed=3, dtype=jnp.bfloat16)
    seg = jnp.asarray(np.r_[np.ones(90), np.full(166, 2)].astype(np.int32))[None]
    out = flash_attention(q, k, v, seg, scale=0.3, block=128, interpret=True)
    ref = blocked_attention(q, k, v, scale=0.3, segment_ids=seg)
    assert out.dtype == jnp.bfloat16
    _close(out, ref, 3e-2)  # bf16 rounding of O(1) values


def test_supported_shapes_and_errors():
    assert flash_supported(256, 64) and flash_supported(1024, 128) and flash_supported(384, 64, block=256)
    assert not flash_supported(200, 64) and not flash_supported(64, 64) and not flash_supported(256, 12)
    q, k, v = _qkv(t=200)
    with pytest.raises(ValueError, match="multiple of 128"):
        flash_attention(q, k, v, interpret=True)


def test_projections_policy_keeps_output_and_lse(capsys):
    """Under remat "projections_saveable" the backward pass reuses the forward kernel's output and
    log-sum-exp (named as the tiled path's) instead of running the forward kernel again."""
    q, k, v = _qkv(b=1, t=128, h=2, kv=2)
    kept = {}
    for policy in ("projections_saveable", "nothing_saveable"):
        f = jax.checkpoint(lambda q, k, v: flash_attention(q, k, v, interpret=True).sum(),
                           policy=lookup_checkpoint_policy(policy))  # fmt: skip
        jax.ad_checkpoint.print_saved_residuals(f, q, k, v)
        kept[policy] = sorted(line.split()[0] for line in capsys.readouterr().out.splitlines() if "named" in line)
    assert kept == {"projections_saveable": ["f32[1,2,1,128]", "i32[1,1,1]", "u32[1,2,64,128]"], "nothing_saveable": []}


def test_a_model_asking_for_flash_equals_blocked_and_refuses_windows():
    from needle.config import model_preset
    from needle.hardware import settings_for
    from needle.model.decoder.transformer import Transformer
    from needle.model.lora import init_params

    cfg = model_preset("tiny")
    blocked = dataclasses.replace(settings_for("cpu"), attention="blocked", remat="none")
    flash = dataclasses.replace(blocked, attention="flash")
    params = init_params(cfg, None, 0, flash)
    tokens = jnp.asarray(np.random.default_rng(0).integers(1, cfg.vocab_size, (1, 128)), jnp.int32)
    out = Transformer(cfg, settings=flash).apply({"params": params}, tokens)
    ref = Transformer(cfg, settings=blocked).apply({"params": params}, tokens)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-5, rtol=1e-5)
    windowed = cfg.model_copy(update={"sliding_window": 64, "layer_types": ("sliding_attention",) * cfg.n_layers})
    with pytest.raises(ValueError, match="no sliding window"):
        Transformer(windowed, settings=flash).apply({"params": params}, tokens)
