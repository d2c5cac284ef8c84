"""Causal attention through the Pallas TPU splash-attention kernel, same contract as blocked attention.

``splash_attention(q, k, v, ...)`` computes what ``needle.model.decoder.attention.blocked_attention``
computes (causal, grouped-query, optional sliding window, packing's segment ids, Gemma's attention
soft cap) with ``jax.experimental.pallas.ops.tpu.splash_attention``: a flash-attention kernel that
skips the key blocks the mask rules out entirely and, in the backward pass, recomputes the scores
from the saved log-sum-exp instead of keeping probabilities. On a TPU it runs compiled
(``interpret=False``); ``interpret=True`` runs the same kernel through the Pallas interpreter on any
backend (slow, for tests on a machine without a TPU; ``interpret=False`` off a TPU raises a ValueError).

    if splash_supported(t, head_dim):
        out = splash_attention(q, k, v, scale=hd**-0.5, window=None, softcap=None, segment_ids=seg)
    # q [B, T, H, hd], k/v [B, T, K, hd] (H a multiple of K) -> [B, T, H, hd] in q's dtype

What the kernel of this JAX version (0.10.x) takes:

* ``T`` a multiple of 128 (its tiles are 128-lane wide); the block sizes are the largest multiple
  of 128 that is at most ``block`` and divides ``T``.
* head_dim 64 (a 135M Llama) and 128 both run, compiled on a TPU and interpreted: the kernel tiles
  its 128-lane softmax statistics to the head width and slices them. ``splash_supported`` accepts
  multiples of 8; only 64 and 128 were tried.
* grouped-query attention natively (``make_splash_mha`` with ``H % K == 0``): k/v are not repeated.
* a sliding window as ``LocalMask(window_size=(W - 1, 0))`` and the soft cap as
  ``attn_logits_soft_cap``, applied to the scaled logits before the mask, as the reference does.
* no ``scale`` argument: q is multiplied by ``scale`` before the kernel (in q's dtype, so in bf16
  the scaled q is rounded once more than the reference's float32 ``logits * scale``).

Measured on one TPU v5e (JAX 0.10.2, bf16, B=4 T=2048 H=9 K=3, compiled): hd 64 and 128 both run
and match blocked attention to bf16 rounding (forward max |diff| 0.016, gradients 0.4-0.9% of their
largest entry); float32 under ``highest`` matmul precision to 1e-6 (forward) and 5e-5 (gradients).
Square 512 blocks with the fused backward were the fastest of bq, bkv in {128..1024} x fused or not
(fused 10-20% ahead). At these sizes XLA's blocked attention was still faster (fwd+bwd 1.13 vs
1.54 ms at T=2048 hd 64, 2.11 vs 2.62 ms at T=4096; forward alone splash wins at T=4096, 0.87 vs
1.30 ms); what splash saves is memory: no [block, T] score tile per head in HBM.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import splash_attention as sa

from needle.model.decoder.attention import check_self_attention

_LANES = 128  # the kernel's tile width: T and every block size must be a multiple of it
# The checkpoint name of the kernel's forward residuals (its output and log-sum-exp): remat
# "projections_saveable" keeps them (needle/model/decoder/scan.py), so the backward pass does not
# run the forward kernel again.
SPLASH_RESIDUALS = "splash_residuals"


def splash_supported(t: int, head_dim: int) -> bool:
    """Whether the kernel takes a sequence of ``t`` positions with heads of ``head_dim``."""
    # head_dim: the kernel tiles it by cdiv(head_dim, 128) and slices, so 64 works as well as 128;
    # below 8 (a sublane) or odd sizes it has never been tried, so they are refused.
    return t >= _LANES and t % _LANES == 0 and head_dim >= 8 and head_dim % 8 == 0


def lane_block_size(t: int, block: int) -> int:
    """The largest multiple of 128 that is at most ``block`` and divides ``t`` (``t % 128 == 0``)."""
    b = max(_LANES, min(block, t) // _LANES * _LANES)
    while t % b:
        b -= _LANES
    return b


@functools.lru_cache(maxsize=64)
def _kernel(
    t: int, heads: int, window: int | None, softcap: float | None, block: int, interpret: bool
) -> sa.splash_attention_kernel.SplashAttentionKernel:
    """One kernel per static configuration: building it walks the mask block by block in numpy
    (the MaskInfo tables of which key blocks each query block needs), far too slow per call."""
    shape = (t, t)
    if window is None:
        head_mask: sa.Mask = sa.CausalMask(shape)
    else:
        # A query at p sees keys p-W+1..p: W-1 to the left, none to the right.
        head_mask = sa.LocalMask(shape, window_size=(window - 1, 0), offset=0)
    mask = sa.MultiHeadMask([head_mask] * heads)  # identical per head: processed once, shared
    b = lane_block_size(t, block)
    sizes = sa.BlockSizes(
        block_q=b, block_kv=b, block_kv_compute=b,
        # Backward blocks are what make the kernel differentiable; the fused kernel computes dq
        # with dk/dv in one pass over the scores instead of a second dq kernel recomputing them.
        block_q_dkv=b, block_kv_dkv=b, block_kv_dkv_compute=b, use_fused_bwd_kernel=True,
    )  # fmt: skip
    # Usually first built inside a jit trace (the model's): compile-time evaluation keeps the mask
    # tables concrete arrays, not tracers of that one trace that the cache would then leak into others.
    with jax.ensure_compile_time_eval():
        return sa.make_splash_mha(
            mask, block_sizes=sizes, attn_logits_soft_cap=softcap, head_shards=1, q_seq_shards=1,
            residual_checkpoint_name=SPLASH_RESIDUALS, interpret=interpret,
        )  # fmt: skip


def splash_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, *, scale: float | None = None, window: int | None = None,
    softcap: float | None = None, segment_ids: jax.Array | None = None, interpret: bool = False, block: int = 512,
) -> jax.Array:  # fmt: skip
    """Causal grouped-query attention with the splash kernel (module doc); ``segment_ids`` [B, T]
    lets a token attend only to tokens of its own segment (padding's 0 attends to padding)."""
    b, t, h, hd = q.shape
    check_self_attention(q, k, "splash")
    if not splash_supported(t, hd):
        raise ValueError(f"splash attention needs T a multiple of {_LANES} and a head_dim multiple of 8: {t=}, {hd=}")
    if window is not None and window < 1:
        raise ValueError(f"a sliding window holds at least the query itself: {window=}")
    scale = hd**-0.5 if scale is None else float(scale)
    kernel = _kernel(t, h, window, None if softcap is None else float(softcap), block, interpret)
    # The kernel has no scale: fold it into q, so the soft cap sees scale * q.k as the reference's does.
    qs = (q * scale).astype(q.dtype)
    # The kernel is per batch row with heads leading: [H, T, hd] and [K, T, hd]; vmap adds the batch.
    qs, kt, vt = (x.transpose(0, 2, 1, 3) for x in (qs, k, v))
    if segment_ids is None:
        out = jax.vmap(kernel)(qs, kt, vt)
    else:
        seg = segment_ids.astype(jnp.int32)
        out = jax.vmap(lambda q1, k1, v1, s1: kernel(q1, k1, v1, segment_ids=sa.SegmentIds(q=s1, kv=s1)))(
            qs, kt, vt, seg
        )
    return out.transpose(0, 2, 1, 3).astype(q.dtype)
