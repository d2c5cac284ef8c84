"""Splash attention (needle/model/decoder/splash.py) equals blocked attention, forward and gradients.

The Pallas kernel runs under ``interpret=True`` here (CI has no TPU): the same kernel code, block
skipping and masks included, run by the Pallas interpreter on the CPU. Shapes are the smallest the
kernel takes (T a multiple of 128); ``block=128`` where a test needs several query/key blocks (the
window's skipped blocks, segments crossing block edges)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from needle.model.decoder.attention import blocked_attention
from needle.model.decoder.scan import lookup_checkpoint_policy
from needle.model.decoder.splash import _kernel, splash_attention, splash_supported

# float32: the kernel's online softmax and the reference's exact one differ only in rounding
# (measured here <= 1e-6 forward, <= 5e-6 for gradients of size up to 8). bfloat16: q*scale is rounded
# to bf16 before the kernel and the reference multiplies its probabilities by v in bf16 where the
# kernel keeps float32, so outputs differ by bf16 rounding of O(1) values (measured max 0.0156, one
# ulp at 2..4, here and on a TPU v5e); bf16 gradients by <= 0.5% of their largest entry (0.9% on the TPU).
F32_ATOL = 2e-5
BF16_ATOL = 3e-2
BF16_GRAD_RTOL = 3e-2


def _normal(shape, dtype=jnp.float32, seed=0):
    # numpy, not jax.random: compiling the sampler for each new shape cost ~3 s of CPU per test.
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, np.float32), dtype)


def _qkv(b=2, t=256, h=4, kv=2, hd=64, dtype=jnp.float32, seed=0):
    return tuple(_normal((b, t, n, hd), dtype, seed * 3 + i) for i, n in enumerate((h, kv, kv)))


def _segments(b, t):
    # Row 0: three packed rows (two crossing the 128 block edge) then padding (segment 0);
    # row 1: one row filling the sequence.
    seg = np.zeros((b, t), np.int32)
    seg[0, :100], seg[0, 100:170], seg[0, 170 : t - 40] = 1, 2, 3
    seg[1, :] = 1
    return jnp.asarray(seg)


@functools.cache
def _splash(**kw):
    # One jit per option set: compiling the interpreted kernel is most of each test's time.
    return jax.jit(functools.partial(splash_attention, interpret=True, **kw))


@functools.cache
def _ref(**kw):
    # Jitted too: eager blocked attention dispatches op by op, and its gradient took 4x the jit's CPU time.
    return jax.jit(functools.partial(blocked_attention, **kw))


def _out_and_grads(fn, q, k, v, w, segment_ids=None):
    """``fn``'s output and its gradients w.r.t. q, k, v for the output cotangent ``w`` (random: every
    output element reaches them with its own weight), in one jit: a second compile of the forward
    alone would add a third to an interpreted test's time."""

    def both(q, k, v, w):
        out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, segment_ids=segment_ids), q, k, v)
        return out, vjp(w)

    return jax.jit(both)(q, k, v, w)


def _close(out, ref, atol):
    assert out.dtype == ref.dtype
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=atol, rtol=0)


@pytest.mark.parametrize("kv", [2, 1, 4])  # grouped-query, multi-query, plain multi-head
def test_causal_gqa(kv):
    q, k, v = _qkv(kv=kv)
    _close(_splash()(q, k, v), _ref()(q, k, v), F32_ATOL)


def test_sliding_window_skips_blocks():
    # T=384 in 128-blocks with W=100: the last query block needs no key from the first block.
    q, k, v = _qkv(t=384)
    out = _splash(window=100, block=128)(q, k, v)
    _close(out, _ref(window=100)(q, k, v), F32_ATOL)
    assert not np.allclose(np.asarray(out), np.asarray(_ref()(q, k, v)), atol=1e-3)  # the window bites


def test_segment_ids_packed_with_padding():
    q, k, v = _qkv()
    seg = _segments(2, 256)
    out = _splash(block=128)(q, k, v, segment_ids=seg)
    _close(out, _ref()(q, k, v, segment_ids=seg), F32_ATOL)
    # A packed row's output is that row's attention alone: segment 2 (100..170) as its own sequence.
    alone = _ref()(q[:1, 100:170], k[:1, 100:170], v[:1, 100:170])
    _close(out[:1, 100:170], alone, F32_ATOL)


def test_softcap_and_scale():
    q, k, v = _qkv()
    out = _splash(scale=0.3, softcap=2.0)(q, k, v)
    _close(out, _ref(scale=0.3, softcap=2.0)(q, k, v), F32_ATOL)
    assert not np.allclose(np.asarray(out), np.asarray(_ref(scale=0.3)(q, k, v)), atol=1e-3)


@pytest.mark.parametrize("hd", [64, 128])
def test_bf16_all_options(hd):
    q, k, v = _qkv(hd=hd, dtype=jnp.bfloat16)
    seg = _segments(2, 256)
    kw = dict(window=100, softcap=20.0)
    w = _normal(q.shape, jnp.bfloat16, seed=99)
    out, grads = _out_and_grads(_splash(block=128, **kw), q, k, v, w, seg)
    ref, ref_grads = _out_and_grads(_ref(**kw), q, k, v, w, seg)
    assert out.dtype == jnp.bfloat16 and out.shape == q.shape
    _close(out, ref, BF16_ATOL)
    for g, r in zip(grads, ref_grads):
        _close(g, r, BF16_GRAD_RTOL * float(jnp.max(jnp.abs(r.astype(jnp.float32)))))


@pytest.mark.parametrize(
    "kw", [{}, dict(window=100, softcap=20.0, packed=True)], ids=["causal", "window-softcap-packed"]
)
def test_gradients(kw):
    kw = dict(kw)
    q, k, v = _qkv(seed=1)
    seg = _segments(2, 256) if kw.pop("packed", False) else None
    w = _normal(q.shape, seed=99)
    out, grads = _out_and_grads(_splash(block=128, **kw), q, k, v, w, seg)
    ref, ref_grads = _out_and_grads(_ref(**kw), q, k, v, w, seg)
    _close(out, ref, F32_ATOL)
    for g, r in zip(grads, ref_grads):
        _close(g, r, 5 * F32_ATOL)  # gradients sum over up to T keys: a few times the forward's rounding


def test_supported_shapes():
    assert splash_supported(256, 64) and splash_supported(128, 128) and splash_supported(2048, 64)
    assert not splash_supported(200, 64)  # T not a multiple of 128
    assert not splash_supported(64, 64)  # below one 128 tile
    q, k, v = _qkv(t=200)
    with pytest.raises(ValueError, match="multiple of 128"):
        splash_attention(q, k, v, interpret=True)


def test_kernel_built_once_per_config():
    assert _kernel(256, 4, None, None, 512, True) is _kernel(256, 4, None, None, 512, True)
    assert _kernel(256, 4, 100, None, 512, True) is not _kernel(256, 4, None, None, 512, True)


@pytest.mark.parametrize(("head_dim", "attention", "splash"), [(64, "auto", False), (128, "auto", True), (256, "auto", True),
                                                               (64, "splash", True), (128, "blocked", False)])  # fmt: skip
def test_auto_takes_splash_on_a_tpu_for_heads_of_128_lanes_or_more(monkeypatch, head_dim, attention, splash):
    """On a TPU "auto" sends heads narrower than the kernel's 128 lanes (the 135M Llama's 64) to the
    blocked path, which trained that shape faster there; "splash" asked for is always splash."""
    import dataclasses

    from needle.config import ModelConfig
    from needle.hardware import settings_for
    from needle.model.decoder.block import Attention

    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    settings = dataclasses.replace(settings_for("tpu"), attention=attention)
    cfg = ModelConfig(preset="tiny")
    attn = Attention(cfg, None, settings)
    assert attn._splash(jnp.zeros((1, 256, 2, head_dim))) is splash
    assert attn._splash(jnp.zeros((1, 200, 2, head_dim))) is (attention == "splash")  # T not a multiple of 128


def test_a_model_asking_for_splash_initialises_and_equals_blocked():
    """attention="splash" initialises although init traces a few tokens the kernel refuses (the
    parameters do not depend on the path), and its forward equals the blocked one's."""
    import dataclasses

    from needle.config import model_preset
    from needle.hardware import settings_for
    from needle.model.lora import init_params
    from needle.model.decoder.transformer import Transformer

    cfg = model_preset("tiny")
    blocked = dataclasses.replace(settings_for("cpu"), attention="blocked", remat="none")
    splash = dataclasses.replace(blocked, attention="splash")
    params = init_params(cfg, None, 0, splash)
    assert jax.tree.map(jnp.shape, params) == jax.tree.map(jnp.shape, init_params(cfg, None, 0, blocked))
    tokens = jnp.asarray(np.random.default_rng(0).integers(1, cfg.vocab_size, (1, 128)), jnp.int32)
    out = Transformer(cfg, settings=splash).apply({"params": params}, tokens)
    ref = Transformer(cfg, settings=blocked).apply({"params": params}, tokens)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-5, rtol=1e-5)


def test_projections_policy_keeps_the_kernel_residuals(capsys):
    """Under remat "projections_saveable" the backward pass reuses the forward kernel's output and
    log-sum-exp (the checkpoint name splash.py gives them) instead of running the kernel again;
    "nothing_saveable" keeps only the inputs."""
    q, k, v = _qkv(b=1, t=128, h=2, kv=2)
    kept = {}
    for policy in ("projections_saveable", "nothing_saveable"):
        f = jax.checkpoint(lambda q, k, v: splash_attention(q, k, v, interpret=True).sum(),
                           policy=lookup_checkpoint_policy(policy))  # fmt: skip
        jax.ad_checkpoint.print_saved_residuals(f, q, k, v)
        kept[policy] = [line.split()[0] for line in capsys.readouterr().out.splitlines() if "_splash_attention" in line]
    assert kept == {"projections_saveable": ["f32[1,2,128,64]", "f32[1,2,128]"], "nothing_saveable": []}
