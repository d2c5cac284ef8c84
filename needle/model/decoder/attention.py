"""Causal attention in query blocks: never the full ``[B, H, T, T]`` score tensor.

``blocked_attention(q, k, v, ...)`` computes exactly what the dense path of
needle/model/decoder/block.py's ``Attention`` computes (causal, grouped-query, optional sliding window, packing's
segment ids, Gemma's attention soft cap), one block of ``block`` queries at a time. Packed rows
(``segment_ids``) longer than two blocks go to needle/model/decoder/tiled.py instead, which also
skips the keys of earlier rows. Each query block sees only the key range it can reach (``[start - window + 1,
end)`` for a sliding window, ``[0, end)`` otherwise), so the scores held at once are ``[B, H,
block, <= T]`` and the masked-out upper triangle beyond a block's last query is never computed
(about half of the causal score work at long ``T``). Each block runs under ``jax.checkpoint``:
the backward pass recomputes its scores instead of keeping its probabilities, so training holds
only q, k, v and the output.

Within a block the softmax is exact over the block's whole key range (no online rescaling is
needed because the keys of one block fit at once; ``T`` here is at most a few thousand), in
float32, with masked scores at ``finfo(float32).min`` as the dense path does, so the result equals
it to float32 rounding.

    out = blocked_attention(q, k, v, scale=hd**-0.5, window=None, softcap=None, segment_ids=seg)
    # q [B, T, H, hd], k/v [B, T, K, hd] (H a multiple of K) -> [B, T, H, hd] in v's dtype
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from needle.model.decoder.tiled import NEG_LOGIT, tiled_attention


def _block(
    q: jax.Array, k: jax.Array, v: jax.Array, q_start: int, k_start: int, scale: float, window: int | None,
    softcap: float | None, q_seg: jax.Array | None, k_seg: jax.Array | None,
) -> jax.Array:  # fmt: skip
    """Queries ``q[B, tq, K, G, hd]`` (absolute start ``q_start``) against keys ``k[B, tk, K, hd]``."""
    logits = jnp.einsum("bqkgd,bskd->bkgqs", q, k, preferred_element_type=jnp.float32) * scale
    if softcap is not None:
        logits = softcap * jnp.tanh(logits / softcap)
    qi = q_start + jnp.arange(q.shape[1])[:, None]
    ki = k_start + jnp.arange(k.shape[1])[None, :]
    rel = qi - ki
    mask = (rel >= 0) if window is None else (rel >= 0) & (rel < window)
    mask = mask[None, None, None]  # [1, 1, 1, tq, tk]
    if q_seg is not None:
        mask = mask & (q_seg[:, None, None, :, None] == k_seg[:, None, None, None, :])
    logits = jnp.where(mask, logits, NEG_LOGIT)
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    return jnp.einsum("bkgqs,bskd->bqkgd", probs, v)


def check_self_attention(q: jax.Array, k: jax.Array, path: str) -> int:
    """The number of key/value heads of grouped-query self-attention, after checking the shapes."""
    h, kv = q.shape[2], k.shape[2]
    if h % kv:
        raise ValueError(f"{h} query heads are not a multiple of {kv} key/value heads")
    if k.shape[1] != q.shape[1]:
        raise ValueError(f"{path} attention is self-attention: {q.shape[1]} queries, {k.shape[1]} keys")
    return kv


def blocked_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, *, scale: float | None = None, window: int | None = None,
    softcap: float | None = None, segment_ids: jax.Array | None = None, block: int = 256, checkpoint: bool = True,
) -> jax.Array:  # fmt: skip
    """Causal grouped-query attention in query blocks of ``block`` (module doc); ``checkpoint=False``
    leaves rematerialisation to the caller (a block-level remat policy already recomputes it)."""
    b, t, h, hd = q.shape
    kv = check_self_attention(q, k, "blocked")
    # Packed rows over more than two blocks: key tiles of other rows are skipped (needle/model/decoder/tiled.py).
    # Up to two blocks there is at most one tile pair of three to skip: the small preset's T=288 ran
    # as fast either way (forward+backward 78.5 vs 79.2 ms), and this path keeps its exact softmax.
    if segment_ids is not None and t > 2 * block:
        return tiled_attention(q, k, v, segment_ids, scale=scale, window=window, softcap=softcap, block=block)
    scale = hd**-0.5 if scale is None else float(scale)
    qg = q.reshape(b, t, kv, h // kv, hd)
    fn = jax.checkpoint(_block, static_argnums=(3, 4, 5, 6, 7)) if checkpoint else _block
    outs = []
    for start in range(0, t, block):
        end = min(t, start + block)
        k_start = 0 if window is None else max(0, start - window + 1)
        q_seg = None if segment_ids is None else segment_ids[:, start:end]
        k_seg = None if segment_ids is None else segment_ids[:, k_start:end]
        outs.append(fn(qg[:, start:end], k[:, k_start:end], v[:, k_start:end], start, k_start, scale, window, softcap,
                       q_seg, k_seg))  # fmt: skip
    out = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)
    return out.reshape(b, t, h, hd)


def softcapped_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None, window: int | None, scale: float | None,
    softcap: float, segment_mask: jax.Array | None = None,
) -> jax.Array:  # fmt: skip
    """Attention with ``softcap * tanh(logits / softcap)`` before the mask (Gemma 2 style), in float32.

    ``jax.nn.dot_product_attention`` has no soft cap, so this spells attention out; used only
    by configs that set ``attn_softcap``.
    """
    groups = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    logits = jnp.einsum("bthd,bshd->bhts", q, k, preferred_element_type=jnp.float32) * scale
    logits = softcap * jnp.tanh(logits / softcap)
    if mask is None:
        t, s = q.shape[1], k.shape[1]
        rel = jnp.arange(t)[:, None] - jnp.arange(s)[None, :]
        mask = (rel >= 0) if window is None else (rel >= 0) & (rel < window)
        mask = mask[None, None]
        if segment_mask is not None:
            mask = mask & segment_mask
    logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    return jnp.einsum("bhts,bshd->bthd", probs, v)
