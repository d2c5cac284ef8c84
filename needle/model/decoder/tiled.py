"""Attention over packed rows in key tiles: an online softmax that skips the tiles of other rows.

``tiled_attention(q, k, v, segment_ids, ...)`` computes what ``blocked_attention`` computes for
packed rows (causal, grouped-query, optional sliding window, Gemma's soft cap) one query tile of
at most ``block`` positions at a time, over key tiles of the same size: from the later of the
first tile holding the start of any of its queries' rows (their segment id's first position, the
earliest over the batch) and its window's first tile, up to its own tile. A sequence packing rows
of ``L`` tokens thus costs about ``L / T`` of the causal score work at batch size 1 (the earliest
row start over a batch skips less), where blocked attention scores every earlier key. On the
2-core CPU one attention layer of the 135M Llama shape over 2 x 3216 tokens packing rows of ~1600
took 230 ms forward and 759 ms forward and backward, against blocked attention's 733 and 1795 ms
(2026-12-06).

The softmax runs online over the key tiles in float32 (flash attention), so no row of scores is
ever held whole. Both loops are ``lax`` loops: the program does not grow with ``T`` (a branch per
possible start tile compiled 19 s longer for that shape). The backward pass is a ``custom_vjp``
that recomputes each tile's probabilities from the saved log-sum-exp, so training keeps q, k, v
(as tiles), the float32 output and one float per query and head, never a tile's probabilities.
The result equals the dense path's to float32 rounding (tests/model/test_attention.py).

    out = tiled_attention(q, k, v, segment_ids, scale=hd**-0.5, window=None, softcap=None)
    # q [B, T, H, hd], k/v [B, T, K, hd] (H a multiple of K), segment_ids [B, T] -> [B, T, H, hd]
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

NEG_LOGIT = float(jnp.finfo(jnp.float32).min)  # a masked score (also attention.py's)
_PAD_SEGMENT = int(jnp.iinfo(jnp.int32).min)  # padding up to whole tiles: matches no real segment


def tiled_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, *, scale: float | None = None,
    window: int | None = None, softcap: float | None = None, block: int = 256,
) -> jax.Array:  # fmt: skip
    """Causal grouped-query attention within equal ``segment_ids``, in tiles of ``block`` (module doc)."""
    b, t, h, hd = q.shape
    kv = k.shape[2]
    if h % kv or k.shape[1] != t or segment_ids.shape != (b, t):
        raise ValueError(f"tiled attention: q {q.shape}, k {k.shape}, segment_ids {segment_ids.shape}")
    if window is not None and window < 1:
        raise ValueError(f"tiled attention: window must be >= 1 (a query sees itself), got {window}")
    scale = hd**-0.5 if scale is None else float(scale)
    # As few tiles as ``block`` allows, of near-equal size: T=288 is 2 x 144, not 2 x 256 (padded).
    n = -(-t // block)
    blk = -(-t // n)
    pad = n * blk - t
    seg = segment_ids.astype(jnp.int32)
    if pad:
        q, k, v = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (q, k, v))
        seg = jnp.pad(seg, ((0, 0), (0, pad)), constant_values=_PAD_SEGMENT)
    # Tiles first and heads before positions: every einsum below is a plain batched matmul.
    qt = q.reshape(b, n, blk, kv, h // kv, hd).transpose(1, 0, 3, 4, 2, 5)  # [n, B, K, G, q, hd]
    kt, vt = (x.reshape(b, n, blk, kv, hd).transpose(1, 0, 3, 2, 4) for x in (k, v))  # [n, B, K, s, hd]
    st = seg.reshape(b, n, blk).transpose(1, 0, 2)  # [n, B, q]
    attend = _attention(blk, scale, window, softcap)
    out = attend(qt, kt, vt, st, _first_tiles(seg, blk, window))  # [n, B, K, G, q, hd]
    return out.transpose(1, 0, 4, 2, 3, 5).reshape(b, n * blk, h, hd)[:, :t]


def _first_tiles(seg: jax.Array, blk: int, window: int | None) -> jax.Array:
    """Per query tile, the first key tile any of its queries can attend to, ``[n]`` int32."""
    n = seg.shape[1] // blk

    def row_starts(i: jax.Array) -> jax.Array:
        qs = jax.lax.dynamic_slice_in_dim(seg, i * blk, blk, axis=1)
        # argmax of a boolean row is its first True: the first position of each query's segment id.
        return jnp.min(jnp.argmax(qs[:, :, None] == seg[:, None, :], axis=2), axis=1)  # [B]

    # One minimum over the batch after the loop (one reduction, also across devices).
    lo = jnp.min(jax.lax.map(row_starts, jnp.arange(n)), axis=1) // blk
    if window is not None:
        lo = jnp.maximum(lo, jnp.maximum(jnp.arange(n) * blk - window + 1, 0) // blk)
    return lo.astype(jnp.int32)


def _scores(qi, kj, si, sj, i, j, blk, scale, window, softcap):  # noqa: ANN001, ANN202
    """Float32 scores of query tile ``i`` against key tile ``j`` ``[B, K, G, q, s]``, masked to
    ``NEG_LOGIT``; the mask; and ``tanh`` of the capped logits (for the backward pass) or None."""
    s = jnp.einsum("bkgqd,bksd->bkgqs", qi, kj, preferred_element_type=jnp.float32) * scale
    capped = None
    if softcap is not None:
        capped = jnp.tanh(s / softcap)
        s = softcap * capped
    rel = (i * blk + jnp.arange(blk))[:, None] - (j * blk + jnp.arange(blk))[None, :]
    mask = (rel >= 0) if window is None else (rel >= 0) & (rel < window)
    mask = mask[None, None, None] & (si[:, None, None, :, None] == sj[:, None, None, None, :])
    return jnp.where(mask, s, NEG_LOGIT), mask, capped


@functools.lru_cache(maxsize=None)
def _attention(blk: int, scale: float, window: int | None, softcap: float | None):  # noqa: ANN202
    """The tiled attention for these static settings, with its custom backward pass."""
    scores = functools.partial(_scores, blk=blk, scale=scale, window=window, softcap=softcap)

    def forward_tiles(qt, kt, vt, st, lo):  # noqa: ANN001, ANN202
        _, b, kv, g, _, hd = qt.shape

        def q_tile(i: jax.Array) -> tuple[jax.Array, jax.Array]:
            qi, si = qt[i], st[i]

            def body(j, carry):  # noqa: ANN001, ANN202
                m, l, acc = carry
                s, mask, _ = scores(qi, kt[j], si, st[j], i, j)
                m_new = jnp.maximum(m, s.max(-1))
                p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
                corr = jnp.exp(m - m_new)
                pv = jnp.einsum("bkgqs,bksd->bkgqd", p.astype(vt.dtype), vt[j], preferred_element_type=jnp.float32)
                return m_new, l * corr + p.sum(-1), acc * corr[..., None] + pv

            init = (jnp.full((b, kv, g, blk), NEG_LOGIT), jnp.zeros((b, kv, g, blk)), jnp.zeros((b, kv, g, blk, hd)))
            m, l, acc = jax.lax.fori_loop(lo[i], i + 1, body, init)
            return acc / l[..., None], m + jnp.log(l)  # every query sees itself: l > 0

        return jax.lax.map(q_tile, jnp.arange(qt.shape[0]))  # [n, B, K, G, q, hd], [n, B, K, G, q]

    @jax.custom_vjp
    def attend(qt, kt, vt, st, lo):  # noqa: ANN001, ANN202
        return forward_tiles(qt, kt, vt, st, lo)[0].astype(vt.dtype)

    def fwd(qt, kt, vt, st, lo):  # noqa: ANN001, ANN202
        out, lse = forward_tiles(qt, kt, vt, st, lo)
        # Named for remat "projections_saveable" (needle/model/decoder/scan.py): kept, the backward
        # pass does not run the forward tiles again.
        out, lse = checkpoint_name(out, "attn_out"), checkpoint_name(lse, "attn_lse")
        return out.astype(vt.dtype), (qt, kt, vt, st, lo, out, lse)

    def bwd(res, dout):  # noqa: ANN001, ANN202
        qt, kt, vt, st, lo, out, lse = res
        dout = dout.astype(jnp.float32)
        delta = jnp.sum(dout * out, axis=-1)  # rowsum(dO * O), [n, B, K, G, q]

        def q_tile(carry, i):  # noqa: ANN001, ANN202
            qi, si, gi = qt[i], st[i], dout[i].astype(vt.dtype)

            def body(j, c):  # noqa: ANN001, ANN202
                dq, dk, dv = c
                kj, vj = kt[j], vt[j]
                s, mask, capped = scores(qi, kj, si, st[j], i, j)
                # Matmul operands in the inputs' dtype (bfloat16 on accelerators), sums in float32.
                p = jnp.where(mask, jnp.exp(s - lse[i][..., None]), 0.0)
                pv = jnp.einsum("bkgqs,bkgqd->bksd", p.astype(vj.dtype), gi, preferred_element_type=jnp.float32)
                dv = dv.at[j].add(pv)
                dp = jnp.einsum("bkgqd,bksd->bkgqs", gi, vj, preferred_element_type=jnp.float32)
                ds = p * (dp - delta[i][..., None])
                if capped is not None:
                    ds = ds * (1.0 - capped * capped)
                ds = ds * scale
                ds = ds.astype(qi.dtype)
                dq = dq + jnp.einsum("bkgqs,bksd->bkgqd", ds, kj, preferred_element_type=jnp.float32)
                dk = dk.at[j].add(jnp.einsum("bkgqs,bkgqd->bksd", ds, qi, preferred_element_type=jnp.float32))
                return dq, dk, dv

            dk, dv = carry
            dq, dk, dv = jax.lax.fori_loop(lo[i], i + 1, body, (jnp.zeros(qi.shape, jnp.float32), dk, dv))
            return (dk, dv), dq

        zeros = jnp.zeros(kt.shape, jnp.float32)
        (dk, dv), dq = jax.lax.scan(q_tile, (zeros, zeros), jnp.arange(qt.shape[0]))
        return dq.astype(qt.dtype), dk.astype(kt.dtype), dv.astype(vt.dtype), None, None

    attend.defvjp(fwd, bwd)
    return attend
