"""Needle 3's training-time fake quantisation (activations, KV, CQ weights), as cactus-needle 3.2.8 computes it.

Ported from cactus-needle 3.2.8 ``needle/model/quantize.py`` (Apache-2.0). The reference keeps
``ACT_BITS``/``KV_BITS`` in module globals set by ``configure_deploy``; here they are arguments,
taken from the model's ``Needle3Config`` (``act_bits``, ``kv_bits``), which is what the
reference's fine-tuning sets them to. Every function is pure and straight-through (the forward
value is quantised, the gradient is the identity).

    cq_ste_params(params, WEIGHT_BITS)   # weights as the W4 export sees them (QAT)
    fake_quant_act(x, act_bits)          # per-vector symmetric activation quantisation
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

WEIGHT_BITS = 4  # the export's CQ weight bits (reference quantize.WEIGHT_BITS)
CQ_GROUP_SIZE = 128
KV_GROUP = 64  # reference quantize._KV_GROUP (configure_deploy's default kv_group)
TERNARY_BITS = 1.58
_TERNARY_CB = np.array([-1.2240064, 0.0, 1.2240064])


def fake_quant(w: jax.Array, group_size: int = 128, bits: int = 4) -> jax.Array:
    """Symmetric absmax quantisation in groups along the last axis, straight-through."""
    qmax = 2 ** (bits - 1) - 1
    d = w.shape[-1]
    pad = (-d) % group_size
    wp = jnp.pad(w, [(0, 0)] * (w.ndim - 1) + [(0, pad)]) if pad else w
    g = wp.reshape(*wp.shape[:-1], -1, group_size).astype(jnp.float32)
    absmax = jnp.max(jnp.abs(g), axis=-1, keepdims=True)
    scale = jnp.where(absmax > 0, absmax / qmax, 1.0)
    q = jnp.clip(jnp.round(g / scale), -qmax - 1, qmax) * scale
    q = q.reshape(wp.shape).astype(w.dtype)
    if pad:
        q = q[..., :d]
    return w + jax.lax.stop_gradient(q - w)


def fake_quant_act(x: jax.Array, act_bits: int) -> jax.Array:
    """The reference's ``_aq(x, True)``: one group per vector at ``act_bits``."""
    return fake_quant(x, x.shape[-1], act_bits)


def quant_query(x: jax.Array, act_bits: int) -> jax.Array:
    """Per-head A8 query quantisation (skipped when ``act_bits`` is 0, as the reference does)."""
    return fake_quant(x, x.shape[-1], 8) if act_bits else x


def quant_kv(x: jax.Array, kv_bits: int) -> jax.Array:
    """KV quantisation of the deployed cache: per-head A8 at >= 8 bits, CQ below, none at 0."""
    if not kv_bits:
        return x
    if kv_bits >= 8:
        return fake_quant(x, x.shape[-1], 8)
    return x + jax.lax.stop_gradient(cq_quantize(x, kv_bits, KV_GROUP) - x)


@functools.lru_cache(maxsize=None)
def _lloyd_max_gaussian(bits: int, iters: int = 200, samples: int = 400000, seed: int = 0) -> np.ndarray:
    if bits == 1:
        c = math.sqrt(2.0 / math.pi)
        return np.array([-c, c])
    levels = 1 << bits
    x = np.sort(np.random.RandomState(seed).randn(samples))
    c = x[((np.arange(levels) + 0.5) / levels * samples).astype(int)].astype(np.float64)
    for _ in range(iters):
        bnd = (c[:-1] + c[1:]) / 2.0
        idx = np.searchsorted(bnd, x)
        for k in range(levels):
            m = idx == k
            if m.any():
                c[k] = x[m].mean()
    return np.sort(c)


@functools.lru_cache(maxsize=None)
def _cq_codebook_np(bits: float, group_size: int) -> np.ndarray:
    cb = _TERNARY_CB if bits == TERNARY_BITS else _lloyd_max_gaussian(bits)
    return (cb / np.sqrt(group_size)).astype(np.float32)


@functools.lru_cache(maxsize=None)
def _cq_hadamard_np(group_size: int) -> np.ndarray:
    h = np.array([[1.0]], dtype=np.float32)
    while h.shape[0] < group_size:
        h = np.block([[h, h], [h, -h]])
    return (h / np.sqrt(group_size)).astype(np.float32)


def _cq_nearest(x: jax.Array, cb: jax.Array) -> jax.Array:
    flat = x.reshape(-1)
    pos = jnp.clip(jnp.searchsorted(cb, flat), 1, cb.shape[0] - 1)
    left, right = cb[pos - 1], cb[pos]
    idx = jnp.where(jnp.abs(flat - left) <= jnp.abs(flat - right), pos - 1, pos)
    return cb[idx].reshape(x.shape)


def cq_quantize(w: jax.Array, bits: float, group_size: int = CQ_GROUP_SIZE) -> jax.Array:
    """Codebook quantisation: Hadamard-rotated groups, fp16 norms, Lloyd-Max unit codebook."""
    cb = jnp.asarray(_cq_codebook_np(bits, group_size))
    d, g = w.shape[-1], group_size
    pad = (-d) % g
    wp = jnp.pad(w, [(0, 0)] * (w.ndim - 1) + [(0, pad)]) if pad else w
    groups = wp.reshape(*wp.shape[:-1], -1, g).astype(jnp.float32)
    h = jnp.asarray(_cq_hadamard_np(g))
    rot = groups @ h
    norm = jnp.sqrt(jnp.sum(rot**2, axis=-1, keepdims=True))
    unit = rot / jnp.maximum(norm, 1e-12)
    norm = norm.astype(jnp.float16).astype(jnp.float32)
    deq = (_cq_nearest(unit, cb) * norm) @ h
    deq = deq.reshape(wp.shape).astype(w.dtype)
    return deq[..., :d] if pad else deq


def cq_ste(w: jax.Array, bits: float, group_size: int = CQ_GROUP_SIZE) -> jax.Array:
    return w + jax.lax.stop_gradient(cq_quantize(w, bits, group_size) - w)


def is_quant_leaf(key: str, leaf: Any) -> bool:
    """The leaves the export quantises: kernels, embedding tables and mHC projections (2-D and up)."""
    return (key in ("kernel", "embedding") or key.startswith("mhc_phi")) and getattr(leaf, "ndim", 0) >= 2


def cq_ste_params(params: Any, bits: float = WEIGHT_BITS, group_size: int = CQ_GROUP_SIZE) -> Any:
    """Every quantised leaf through :func:`cq_ste`; kernels and mHC maps along their input axis.

    Leaf-wise, so it may be applied to any subtree (the reference applies it to the whole tree).
    """

    def q(path: tuple, leaf: Any) -> Any:
        key = next((str(p.key) for p in reversed(path) if hasattr(p, "key")), "")
        if not is_quant_leaf(key, leaf):
            return leaf
        if key == "kernel" or key.startswith("mhc_phi"):
            return jnp.swapaxes(cq_ste(jnp.swapaxes(leaf, -1, -2), bits, group_size), -1, -2)
        return cq_ste(leaf, bits, group_size)

    return jax.tree_util.tree_map_with_path(q, params)
