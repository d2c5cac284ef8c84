"""Needle 3's layers: zero-centred RMSNorm, gated GQA attention with q/k/v conv taps, Engram
n-gram memory, the Hadamard MLP, the block and the scanned mHC layer body.

Ported from cactus-needle 3.2.8 ``needle/model/architecture.py`` (Apache-2.0). Module and
parameter names are the reference's, so a reference checkpoint's names load 1:1; the ports add
what needle needs around the same arithmetic: explicit ``positions`` (RoPE, cache slots), a
per-call attention ``mask`` that may carry packed-sequence segments, a KV cache (``decode``) that
also keeps the q/k/v and Engram histories the causal convolutions read, LoRA leaves and
quantisation-aware weights (``qat``). See ``architecture.py`` for the model and its contracts.
"""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.nn.initializers as jinit
import jax.numpy as jnp
import numpy as np

from needle.model.needle3 import quantize as qz

ENGRAM_CONV_TAPS = 4
HADA_COND_RANK = 8
_HADA_PERM_SEEDS = (11, 13)


def default_init() -> Any:
    return jinit.normal(stddev=0.02)


def residual_init(num_layers: int) -> Any:
    return jinit.normal(stddev=0.02 / math.sqrt(2 * num_layers))


def conv_identity_init(key: Any, shape: tuple, dtype: Any = jnp.float32) -> jax.Array:
    return jnp.zeros(shape, dtype).at[0].set(1.0)


def rms_unit(x: jax.Array, epsilon: float = 1e-6) -> jax.Array:
    xf = x.astype(jnp.float32)
    return xf * jax.lax.rsqrt(jnp.mean(xf**2, axis=-1, keepdims=True) + epsilon)


def shift_right(x: jax.Array, offset: int) -> jax.Array:
    """``x[:, t - offset]`` along axis 1, zeros before the start."""
    if offset == 0:
        return x
    pad = [(0, 0)] * x.ndim
    pad[1] = (offset, 0)
    return jnp.pad(x, pad)[:, : x.shape[1]]


def mask_diag(mask: jax.Array, offset: int) -> jax.Array:
    """``mask[:, 0, t, t - offset]`` (False before the start): may token t read token t - offset?"""
    m = mask[:, 0]
    t = m.shape[-1]
    if offset >= t:
        return jnp.zeros(m.shape[:-2] + (t,), m.dtype)
    d = jnp.diagonal(m, offset=-offset, axis1=-2, axis2=-1)
    if offset == 0:
        return d
    return jnp.pad(d, ((0, 0), (offset, 0)))


def history(hist: jax.Array, positions: jax.Array, offset: int) -> tuple[jax.Array, jax.Array]:
    """Cache rows ``hist[b, positions - offset]`` and whether that slot exists (``>= 0``)."""
    src = positions - offset
    ok = src >= 0
    rows = jnp.arange(hist.shape[0])[:, None]
    return hist[rows, jnp.maximum(src, 0)], ok


def write_slots(var: Any, value: jax.Array, positions: jax.Array) -> jax.Array:
    """Write ``value[b, t]`` into cache slot ``positions[b, t]``; return the whole cache."""
    rows = jnp.arange(value.shape[0])[:, None]
    var.value = var.value.at[rows, positions].set(value.astype(var.value.dtype))
    return var.value


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Half-split RoPE of ``x[B, H, T, hd]`` with ``cos/sin [B, 1, T, hd/2]`` (float32)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def sinkhorn(logits: jax.Array, iters: int = 20) -> jax.Array:
    log_k = logits
    for _ in range(iters):
        log_k = log_k - jax.nn.logsumexp(log_k, axis=-1, keepdims=True)
        log_k = log_k - jax.nn.logsumexp(log_k, axis=-2, keepdims=True)
    return jnp.exp(log_k)


def res_identity_init(key: Any, shape: tuple, dtype: Any = jnp.float32) -> jax.Array:
    return jnp.broadcast_to(4.0 * jnp.eye(shape[-1], dtype=dtype), shape)


def act_quant(x: jax.Array, quant: bool, act_bits: int) -> jax.Array:
    return qz.fake_quant_act(x, act_bits) if quant else x


class ZCRMSNorm(nn.Module):
    """RMSNorm scaled by ``1 + scale`` (scale starts at zero)."""

    epsilon: float = 1e-6
    dtype: Any = jnp.bfloat16

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param("scale", jinit.zeros, (x.shape[-1],))
        rms = jnp.sqrt(jnp.mean(x.astype(jnp.float32) ** 2, axis=-1, keepdims=True) + self.epsilon)
        return ((1 + scale) * x / rms).astype(self.dtype)


class Dense(nn.Module):
    """``flax.linen.Dense`` (no bias) with optional LoRA leaves and CQ weights under QAT.

    The weight used is ``kernel + scale·(lora_a @ lora_b)`` (the reference's ``merge_lora``),
    then, with ``qat``, straight-through CQ at ``WEIGHT_BITS`` along the input axis (its
    ``cq_ste_params``), exactly the reference's LoRA ``loss_fn`` numerics.
    """

    features: int
    dtype: Any = jnp.float32
    kernel_init: Any = None
    lora_rank: int = 0
    lora_scale: float = 1.0
    qat: bool = False

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        d_in = x.shape[-1]
        w = self.param("kernel", self.kernel_init or default_init(), (d_in, self.features))
        if self.lora_rank:
            a = self.param("lora_a", jinit.normal(stddev=1.0 / self.lora_rank), (d_in, self.lora_rank))
            b = self.param("lora_b", jinit.zeros, (self.lora_rank, self.features))
            w = w + (self.lora_scale * jnp.matmul(a, b)).astype(w.dtype)
        if self.qat:
            w = jnp.swapaxes(qz.cq_ste(jnp.swapaxes(w, -1, -2), qz.WEIGHT_BITS), -1, -2)
        x, w = x.astype(self.dtype), w.astype(self.dtype)
        return jax.lax.dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())))


class Engram(nn.Module):
    """Hashed n-gram memory: per-table embeddings -> key/value projections -> dilated causal conv.

    ``hist`` (decoding) is the cache variable of pre-conv values, read at ``positions - j·dilation``.
    """

    d_model: int
    num_tables: int
    slots: int
    sub_dim: int
    num_layers: int
    conv_dilation: int
    dtype: Any = jnp.bfloat16
    act_bits: int = 8
    qat: bool = False

    @nn.compact
    def __call__(self, indices: jax.Array, ngram_ok: jax.Array, tap_ok: jax.Array, quant: bool = False,
                 positions: jax.Array | None = None, decode: bool = False) -> tuple[jax.Array, jax.Array]:  # fmt: skip
        tables = jnp.asarray(self.param("embedding", default_init(), (self.num_tables, self.slots, self.sub_dim)))
        if self.qat:
            tables = qz.cq_ste(tables, qz.WEIGHT_BITS)
        fetched = tables[jnp.arange(self.num_tables), indices]
        fetched = fetched * ngram_ok[..., None]
        e = fetched.reshape(*indices.shape[:2], self.num_tables * self.sub_dim)
        e = act_quant(e.astype(self.dtype), quant, self.act_bits)
        k = Dense(self.d_model, self.dtype, default_init(), qat=self.qat, name="key_proj")(e)
        v = Dense(self.d_model, self.dtype, residual_init(self.num_layers), qat=self.qat, name="value_proj")(e)
        taps = self.param("taps", conv_identity_init, (ENGRAM_CONV_TAPS, self.d_model)).astype(self.dtype)
        if decode:
            b = v.shape[0]
            var = self.variable("cache", "value_history", jnp.zeros, (b, v.shape[1], self.d_model), v.dtype)
            hist = write_slots(var, v, positions)
            shifted = [history(hist, positions, j * self.conv_dilation)[0] for j in range(ENGRAM_CONV_TAPS)]
        else:
            shifted = [shift_right(v, j * self.conv_dilation) for j in range(ENGRAM_CONV_TAPS)]
        v = sum(taps[j] * shifted[j] * tap_ok[j][..., None] for j in range(ENGRAM_CONV_TAPS))
        return k, v


def _hada_blocks(n: int) -> tuple[int, int]:
    b = 1 << ((n - 1).bit_length() // 2)
    return b, n // b


def _walsh_matrix(n: int) -> np.ndarray:
    h = np.array([[1.0]], dtype=np.float32)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(n)


def _hada_perms(n: int, split: bool = False) -> tuple[jax.Array, ...]:
    if split:
        h = n // 2
        return tuple(
            jnp.asarray(np.concatenate([np.random.RandomState(s).permutation(h),
                                        h + np.random.RandomState(s + 977).permutation(h)]))
            for s in _HADA_PERM_SEEDS
        )  # fmt: skip
    return tuple(jnp.asarray(np.random.RandomState(s).permutation(n)) for s in _HADA_PERM_SEEDS)


def _kron_apply(z: jax.Array, a: jax.Array, b: jax.Array) -> jax.Array:
    lead = z.shape[:-1]
    z = z.reshape(*lead, a.shape[0], b.shape[0])
    z = jnp.einsum("...ij,ik,jl->...kl", z, a, b)
    return z.reshape(*lead, a.shape[0] * b.shape[0])


def _walsh_init(size: int) -> Any:
    w = _walsh_matrix(size)
    return lambda key, shape: jnp.asarray(w)


class HadamardMLP(nn.Module):
    """Kronecker-factored Walsh transforms with diagonal gains and a rank-8 conditioner."""

    d_model: int
    dtype: Any = jnp.bfloat16
    split_perms: bool = False

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        n = 1 << (self.d_model - 1).bit_length()
        ba, bb = _hada_blocks(n)
        p1, p2 = _hada_perms(n, self.split_perms)
        factors = [
            (self.param(f"w{s}a", _walsh_init(ba), (ba, ba)).astype(self.dtype),
             self.param(f"w{s}b", _walsh_init(bb), (bb, bb)).astype(self.dtype))
            for s in (1, 2, 3)
        ]  # fmt: skip
        d1 = self.param("d1", jinit.ones, (n,)).astype(self.dtype)
        d2 = self.param("d2", jinit.ones, (n,)).astype(self.dtype)
        b2 = self.param("b2", jinit.zeros, (n,)).astype(self.dtype)
        d3 = self.param("d3", jinit.ones, (n,)).astype(self.dtype)
        d4 = self.param("d4", jinit.constant(0.02), (n,)).astype(self.dtype)
        cond_v = self.param("cond_v", default_init(), (self.d_model, HADA_COND_RANK)).astype(self.dtype)
        cond_u = self.param("cond_u", jinit.zeros, (HADA_COND_RANK, n)).astype(self.dtype)
        cond = 1 + nn.softmax(x @ cond_v, axis=-1) @ cond_u
        pad = n - self.d_model
        z = jnp.pad(x, ((0, 0), (0, 0), (0, pad))) if pad else x
        z = _kron_apply(d1 * z, *factors[0])[..., p1]
        z = _kron_apply(nn.silu(d2 * cond * z + b2), *factors[1])[..., p2]
        z = _kron_apply(d3 * z, *factors[2])
        return (d4 * z)[..., : self.d_model]
