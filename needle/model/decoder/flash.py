"""Causal attention over packed rows as a Pallas TPU flash kernel for narrow heads (head_dim < 128).

``flash_attention(q, k, v, segment_ids, ...)`` computes what ``tiled_attention`` computes for
packed rows (causal, grouped-query, ``segment_ids`` keeping rows apart; no sliding window or soft
cap) with two Pallas kernels, forward and a fused backward (dq, dk and dv in one pass over the
scores). Splash (needle/model/decoder/splash.py) serves heads of 128 and wider; at head_dim 64 it
and XLA's tiled loops both run at about a sixth of the MXU's rate on a TPU v5e, bound by the
element-wise softmax work on every score and by float32 score tiles in HBM (tiled). This kernel
keeps every score tile in VMEM and does less per score:

* A table per batch row and tile pair (``[B, n, n]``, scalar-prefetched into SMEM) says whether
  the tile pair holds no pair of one segment (skipped: packed rows' earlier neighbours), only
  pairs of one segment strictly below the diagonal (no mask computed), or a mix (masked).
* Scores are laid out keys x queries (``s^T``), so the softmax statistics (max, sum, log-sum-exp)
  and the backward's ``rowsum(dO * O)`` are rows of 128-lane vectors: the log-sum-exp saved for
  the backward pass is ``[B, H, 1, T]`` float32, not replicated across 128 lanes.
* The keys and values of a whole row stay in VMEM for the forward (one DMA per row and head); the
  backward keeps a row's queries and output gradients of a key/value head's query group, so
  grouped-query heads share their keys' tiles and dq accumulates in VMEM across key tiles.

Measured on the TPU v5e (2026-12-07, 8 x 1024, 9/3 heads of 64) it is still slower than the tiled
path (one layer forward+backward 0.807 ms in tiles of 512, 0.904 in 256, against 0.749; the 135M
LoRA step 219.5 ms against 168.8), so ``auto`` does not take it.

The output is ``[B, H, hd, T]`` inside (queries on lanes) and transposed back by XLA. ``interpret=True``
runs the same kernels through the Pallas interpreter on any backend (tests on the CPU).

    out = flash_attention(q, k, v, segment_ids, scale=hd**-0.5, block=256)
    # q [B, T, H, hd], k/v [B, T, K, hd] (H a multiple of K), segment_ids [B, T] -> [B, T, H, hd]
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from needle.model.decoder.attention import check_self_attention
from needle.model.decoder.splash import lane_block_size

_LANES = 128  # a TPU vector's lanes: T and every tile a multiple of it
_NEG = float(jnp.finfo(jnp.float32).min)
_NT = (((1,), (1,)), ((), ()))  # a @ b.T
_NN = (((1,), (0,)), ((), ()))  # a @ b
_TN = (((0,), (0,)), ((), ()))  # a.T @ b
SKIP, FULL, MASKED = 0, 1, 2  # what a (query tile, key tile) pair needs


def flash_supported(t: int, head_dim: int, block: int = 256) -> bool:
    """Whether the kernel takes ``t`` positions with heads of ``head_dim`` in tiles of ``block``
    (tiles of splash's ``lane_block_size``: a multiple of 128 dividing ``t``)."""
    return t >= _LANES and t % _LANES == 0 and block >= _LANES and head_dim % 8 == 0 and 8 <= head_dim <= 256


def tile_table(segment_ids: jax.Array, blk: int) -> jax.Array:
    """``[B, n, n]`` int32: SKIP, FULL or MASKED for query tile i against key tile j (module doc).

    SKIP where key tile j ends before the first position of every segment in query tile i (a
    segment's first position comes from a sort by (id, position): O(T log T), where comparing
    every pair of positions cost XLA's estimate as much as the kernel itself at 8 x 1024). Exact
    for packed rows; with an id that recurs after another row's, a tile pair between the two is
    MASKED rather than SKIP (computed and masked: the same result, less skipped)."""
    b, t = segment_ids.shape
    n = t // blk
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    ids, order = jax.lax.sort((segment_ids, pos), dimension=1, num_keys=2)
    new_id = jnp.concatenate([jnp.ones((b, 1), bool), ids[:, 1:] != ids[:, :-1]], axis=1)
    run_start = jax.lax.cummax(jnp.where(new_id, pos, 0), axis=1)
    first = jnp.zeros_like(pos).at[jnp.arange(b)[:, None], order].set(jnp.take_along_axis(order, run_start, axis=1))
    reach = first.reshape(b, n, blk).min(axis=2) // blk  # [B, n]: the first key tile query tile i needs
    st = segment_ids.reshape(b, n, blk)
    i = jnp.arange(n)
    below = i[:, None] > i[None, :]
    uniform = jnp.all(st == st[:, :, :1], axis=2)  # [B, n]: one segment in the tile
    one_segment = uniform[:, :, None] & uniform[:, None, :] & (st[:, :, None, 0] == st[:, None, :, 0])
    needed = (below & (i[None, None, :] >= reach[:, :, None])) | (i[:, None] == i[None, :])
    table = jnp.where(below & one_segment, FULL, jnp.where(needed, MASKED, SKIP))
    return table.astype(jnp.int32)


def _mask(seg_k: jax.Array, seg_q: jax.Array, diagonal: bool, blk: int) -> jax.Array:
    """``[blk keys, blk queries]`` from key ids ``[blk, 128]`` (lane-replicated) and query ids
    ``[1, blk]``: key of the query's segment and, on the diagonal tile, not after the query (below
    it every key precedes every query, and the causal test is skipped)."""
    same = jnp.tile(seg_k, (1, blk // _LANES)) == seg_q
    if not diagonal:
        return same
    causal = jax.lax.broadcasted_iota(jnp.int32, (blk, blk), 0) <= jax.lax.broadcasted_iota(jnp.int32, (blk, blk), 1)
    return causal & same


def _forward_kernel(tbl_ref, q_ref, k_ref, vt_ref, segq_ref, segk_ref, o_ref, lse_ref, m_scr, l_scr, acc_scr,
                    *, blk: int):  # fmt: skip
    """Program (b, h, i): query tile i of head h against key tiles 0..i of its key/value head, the
    diagonal tile first (every query's running maximum is then finite: a masked score adds exp(-inf))."""
    b, i = pl.program_id(0), pl.program_id(2)
    q = q_ref[...]  # [blk, hd], scaled
    seg_q = segq_ref[...]  # [1, blk]

    def update(j: jax.Array, masked: str | None, first: bool = False) -> None:
        start = pl.multiple_of(j * blk, blk)
        k = k_ref[pl.ds(start, blk), :]
        vt = vt_ref[:, pl.ds(start, blk)]  # [hd, keys]: v transposed by XLA, not per tile here
        s = jax.lax.dot_general(k, q, _NT, preferred_element_type=jnp.float32)  # [keys, queries]
        if masked:
            s = jnp.where(_mask(segk_ref[pl.ds(start, blk), :], seg_q, masked == "diagonal", blk), s, _NEG)
        m_tile = jnp.max(s, axis=0, keepdims=True)
        if first:
            m_new = m_tile
        else:
            m_prev = m_scr[...]
            m_new = jnp.maximum(m_prev, m_tile)
        p = jnp.exp(s - m_new)
        pv = jax.lax.dot_general(vt, p.astype(vt.dtype), _NN, preferred_element_type=jnp.float32)  # [hd, queries]
        if first:
            l_scr[...] = jnp.sum(p, axis=0, keepdims=True)
            acc_scr[...] = pv
        else:
            corr = jnp.exp(m_prev - m_new)
            l_scr[...] = l_scr[...] * corr + jnp.sum(p, axis=0, keepdims=True)
            acc_scr[...] = acc_scr[...] * corr + pv
        m_scr[...] = m_new

    update(i, "diagonal", first=True)

    def body(j: jax.Array, carry: None) -> None:
        kind = tbl_ref[b, i, j]
        pl.when(kind == FULL)(lambda: update(j, None))
        pl.when(kind == MASKED)(lambda: update(j, "segment"))
        return carry

    jax.lax.fori_loop(0, i, body, None)
    l = l_scr[...]  # every query sees itself: l > 0
    o_ref[...] = (acc_scr[...] / l).astype(o_ref.dtype)
    lse_ref[...] = m_scr[...] + jnp.log(l)


def _backward_kernel(tbl_ref, q_ref, do_ref, lse_ref, delta_ref, k_ref, v_ref, segq_ref, segk_ref,
                     dq_ref, dk_ref, dv_ref, dq_scr, dk_scr, dv_scr, *, blk: int, groups: int, n: int):  # fmt: skip
    """Program (b, kv head, j): key tile j against query tiles j..n-1 of the head's query group
    (the tile pair's kind and mask read once for the group's heads)."""
    b, j = pl.program_id(0), pl.program_id(2)

    @pl.when(j == 0)
    def _() -> None:
        dq_scr[...] = jnp.zeros(dq_scr.shape, jnp.float32)

    dk_scr[...] = jnp.zeros(dk_scr.shape, jnp.float32)
    dv_scr[...] = jnp.zeros(dv_scr.shape, jnp.float32)
    k = k_ref[...]  # [blk, hd]
    kt = k.T  # once per program: dq's matmul then needs no transposed operand per tile
    v = v_ref[...]
    seg_k = segk_ref[...]  # [blk, 128]

    def update(i: jax.Array, masked: str | None) -> None:
        start = pl.multiple_of(i * blk, blk)
        mask = None if masked is None else _mask(seg_k, segq_ref[:, pl.ds(start, blk)], masked == "diagonal", blk)
        for g in range(groups):
            q = q_ref[g, pl.ds(start, blk), :]  # [blk, hd], scaled
            do = do_ref[g, pl.ds(start, blk), :]
            lse = lse_ref[g, :, pl.ds(start, blk)]  # [1, blk]
            delta = delta_ref[g, :, pl.ds(start, blk)]
            s = jax.lax.dot_general(k, q, _NT, preferred_element_type=jnp.float32)  # [keys, queries]
            p = jnp.exp(s - lse)
            if mask is not None:
                p = jnp.where(mask, p, 0.0)
            dv_scr[...] += jax.lax.dot_general(p.astype(do.dtype), do, _NN, preferred_element_type=jnp.float32)
            dp = jax.lax.dot_general(v, do, _NT, preferred_element_type=jnp.float32)
            ds = (p * (dp - delta)).astype(q.dtype)
            dk_scr[...] += jax.lax.dot_general(ds, q, _NN, preferred_element_type=jnp.float32)
            # dq transposed ([hd, queries]): no operand of this matmul is the transposed score tile
            dq_scr[g, :, pl.ds(start, blk)] += jax.lax.dot_general(kt, ds, _NN, preferred_element_type=jnp.float32)

    def body(i: jax.Array, carry: None) -> None:
        kind = tbl_ref[b, i, j]
        pl.when(kind == FULL)(lambda: update(i, None))
        pl.when((kind == MASKED) & (i != j))(lambda: update(i, "segment"))
        pl.when(i == j)(lambda: update(i, "diagonal"))
        return carry

    jax.lax.fori_loop(j, n, body, None)
    dk_ref[...] = dk_scr[...].astype(dk_ref.dtype)
    dv_ref[...] = dv_scr[...].astype(dv_ref.dtype)

    @pl.when(j == n - 1)
    def _() -> None:
        dq_ref[...] = dq_scr[...].astype(dq_ref.dtype)


def _params(interpret: bool, semantics: tuple[str, ...]) -> dict:
    """pallas_call's compiler parameters (none in the interpreter)."""
    if interpret:
        return {}
    return {"compiler_params": pltpu.CompilerParams(dimension_semantics=semantics, vmem_limit_bytes=64 * 2**20)}


def _forward(qh, kh, vh, segq, segk, tbl, blk, interpret):  # noqa: ANN001, ANN202
    """oT ``[B, H, hd, T]`` and lse ``[B, H, 1, T]`` of scaled ``qh [B, H, T, hd]``, ``kh/vh [B, K, T, hd]``."""
    b, h, t, hd = qh.shape
    vt = vh.transpose(0, 1, 3, 2)  # [B, K, hd, T]: the kernel's p·v then transposes no tile
    groups = h // kh.shape[1]
    n = t // blk
    spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(b, h, n),
        in_specs=[
            pl.BlockSpec((None, None, blk, hd), lambda bi, hi, i, tbl: (bi, hi, i, 0)),
            pl.BlockSpec((None, None, t, hd), lambda bi, hi, i, tbl: (bi, jax.lax.div(hi, groups), 0, 0)),
            pl.BlockSpec((None, None, hd, t), lambda bi, hi, i, tbl: (bi, jax.lax.div(hi, groups), 0, 0)),
            pl.BlockSpec((None, 1, blk), lambda bi, hi, i, tbl: (bi, 0, i)),
            pl.BlockSpec((None, t, _LANES), lambda bi, hi, i, tbl: (bi, 0, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, hd, blk), lambda bi, hi, i, tbl: (bi, hi, 0, i)),
            pl.BlockSpec((None, None, 1, blk), lambda bi, hi, i, tbl: (bi, hi, 0, i)),
        ],
        scratch_shapes=[pltpu.VMEM((1, blk), jnp.float32), pltpu.VMEM((1, blk), jnp.float32),
                        pltpu.VMEM((hd, blk), jnp.float32)],
    )  # fmt: skip
    return pl.pallas_call(
        functools.partial(_forward_kernel, blk=blk),
        grid_spec=spec,
        out_shape=[jax.ShapeDtypeStruct((b, h, hd, t), qh.dtype), jax.ShapeDtypeStruct((b, h, 1, t), jnp.float32)],
        interpret=interpret,
        **_params(interpret, ("parallel", "parallel", "parallel")),
    )(tbl, qh, kh, vt, segq, segk)


def _backward(qh, kh, vh, segq, segk, tbl, lse, delta, doh, blk, interpret):  # noqa: ANN001, ANN202
    """dq ``[B, H, T, hd]``, dk, dv ``[B, K, T, hd]`` (gradients w.r.t. the scaled queries); the
    kernel accumulates dq transposed, ``[B, K, G, hd, T]``."""
    b, h, t, hd = qh.shape
    kv = kh.shape[1]
    g = h // kv
    n = t // blk
    q5, do5 = (x.reshape(b, kv, g, t, hd) for x in (qh, doh))
    lse5, delta5 = (x.reshape(b, kv, g, 1, t) for x in (lse, delta))
    whole = pl.BlockSpec((None, None, g, t, hd), lambda bi, ki, j, tbl: (bi, ki, 0, 0, 0))
    rows = pl.BlockSpec((None, None, g, 1, t), lambda bi, ki, j, tbl: (bi, ki, 0, 0, 0))
    tile = pl.BlockSpec((None, None, blk, hd), lambda bi, ki, j, tbl: (bi, ki, j, 0))
    spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(b, kv, n),
        in_specs=[
            whole, whole, rows, rows, tile, tile,
            pl.BlockSpec((None, 1, t), lambda bi, ki, j, tbl: (bi, 0, 0)),
            pl.BlockSpec((None, blk, _LANES), lambda bi, ki, j, tbl: (bi, j, 0)),
        ],
        out_specs=[pl.BlockSpec((None, None, g, hd, t), lambda bi, ki, j, tbl: (bi, ki, 0, 0, 0)), tile, tile],
        scratch_shapes=[pltpu.VMEM((g, hd, t), jnp.float32), pltpu.VMEM((blk, hd), jnp.float32),
                        pltpu.VMEM((blk, hd), jnp.float32)],
    )  # fmt: skip
    dq, dk, dv = pl.pallas_call(
        functools.partial(_backward_kernel, blk=blk, groups=g, n=n),
        grid_spec=spec,
        out_shape=[jax.ShapeDtypeStruct((b, kv, g, hd, t), qh.dtype), jax.ShapeDtypeStruct(kh.shape, kh.dtype),
                   jax.ShapeDtypeStruct(vh.shape, vh.dtype)],
        interpret=interpret,
        # dq accumulates across key tiles (the last axis): those steps run in order.
        **_params(interpret, ("parallel", "parallel", "arbitrary")),
    )(tbl, q5, do5, lse5, delta5, kh, vh, segq, segk)
    return dq.reshape(b, h, hd, t).transpose(0, 1, 3, 2), dk, dv


@functools.lru_cache(maxsize=None)
def _attention(blk: int, interpret: bool):  # noqa: ANN202
    """The kernel pair for these static settings as one differentiable function."""

    @jax.custom_vjp
    def attend(qh, kh, vh, segq, segk, tbl):  # noqa: ANN001, ANN202
        return _forward(qh, kh, vh, segq, segk, tbl, blk, interpret)[0]

    def fwd(qh, kh, vh, segq, segk, tbl):  # noqa: ANN001, ANN202
        out, lse = _forward(qh, kh, vh, segq, segk, tbl, blk, interpret)
        # Named for remat "projections_saveable" (needle/model/decoder/scan.py), as the tiled path's.
        # The output is kept as its bits: remat rounds a kept float to its own precision with an
        # op XLA cannot fuse into a Pallas call, an extra pass over [B, H, hd, T] a layer.
        kept = checkpoint_name(jax.lax.bitcast_convert_type(out, jnp.dtype(f"uint{8 * out.dtype.itemsize}")), "attn_out")
        return out, (qh, kh, vh, segq, segk, tbl, kept, checkpoint_name(lse, "attn_lse"))

    def bwd(res, dout):  # noqa: ANN001, ANN202
        qh, kh, vh, segq, segk, tbl, kept, lse = res
        out = jax.lax.bitcast_convert_type(kept, dout.dtype)
        # rowsum(dO * O) per query, a row of queries like lse: [B, H, 1, T]
        delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=2, keepdims=True)
        doh = dout.transpose(0, 1, 3, 2)  # [B, H, T, hd]
        dq, dk, dv = _backward(qh, kh, vh, segq, segk, tbl, lse, delta, doh, blk, interpret)
        return dq, dk, dv, None, None, None

    attend.defvjp(fwd, bwd)
    return attend


def flash_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None = None, *,
    scale: float | None = None, block: int = 256, interpret: bool = False,
) -> jax.Array:  # fmt: skip
    """Causal grouped-query attention within equal ``segment_ids`` with the flash kernels (module doc)."""
    b, t, h, hd = q.shape
    check_self_attention(q, k, "flash")
    if not flash_supported(t, hd, block):
        raise ValueError(f"flash attention needs T a multiple of {_LANES}, block >= {_LANES} and head_dim a multiple "
                         f"of 8 from 8 to 256: {t=}, {block=}, {hd=}")  # fmt: skip
    blk = lane_block_size(t, block)
    scale = hd**-0.5 if scale is None else float(scale)
    seg = jnp.zeros((b, t), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
    qh = (q * scale).astype(q.dtype).transpose(0, 2, 1, 3)  # [B, H, T, hd]
    kh, vh = (x.transpose(0, 2, 1, 3) for x in (k, v))  # [B, K, T, hd]
    # Named for remat: the backward pass reuses the forward's table, not sorting again per layer.
    tbl = checkpoint_name(tile_table(seg, blk), "attn_tiles")
    # Query ids as a row [B, 1, T]; key ids replicated across 128 lanes [B, T, 128], as splash's (a
    # [B, T, 1] array takes as much memory in the TPU's tiled layout and widens per tile).
    segk = jnp.broadcast_to(seg[:, :, None], (b, t, _LANES))
    out = _attention(blk, interpret)(qh, kh, vh, seg[:, None, :], segk, tbl)  # [B, H, hd, T]
    return out.transpose(0, 3, 1, 2).astype(q.dtype)
