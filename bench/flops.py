"""Model FLOPs per token for a training step, counted from the real parameter tree.

The formulas (also in docs/benchmark.md), for a sequence of ``T`` tokens:

* ``N_mat``: scalars in the block matmul kernels (q, k, v, o, gate, up, down; norms excluded),
  ``N_lora``: scalars in the ``lora_a``/``lora_b`` leaves, ``L`` layers, width ``d``, vocab ``V``.
* attention scores and values, causal (half the ``T x T`` matrix is useful):
  forward ``2·L·T·d`` per token, training ``6·L·T·d`` (the backward of an op with no weights
  still costs two forwards: one grad for each input).
* output projection ``d x V``: forward ``2·d·V``.
* full fine-tuning: ``6·N_mat + 6·L·T·d + 6·d·V`` (forward 2, backward 4 per weight).
* LoRA: the frozen weights still run forward and backward for the activations' gradients but
  get no weight gradient: ``4·N_mat + 6·N_lora + 6·L·T·d + 4·d·V``.

The embedding lookup is a gather (no FLOPs). These are *model* FLOPs: XLA on CPU computes the
full ``T x T`` score matrix, so the hardware does more work than is counted here (the usual MFU
convention, which makes utilisation a conservative figure).
"""

from __future__ import annotations

from typing import Any

from flax import traverse_util

_MATMUL_LEAVES = ("kernel",)
_LORA_LEAVES = ("lora_a", "lora_b")


def count_matmul_params(params: Any) -> dict[str, int]:
    """Scalars in block matmul kernels (``n_mat``) and in adapter leaves (``n_lora``)."""
    flat = traverse_util.flatten_dict(params)
    n_mat = n_lora = 0
    for path, leaf in flat.items():
        size = int(getattr(leaf, "size", 0))
        in_block = any(str(p).startswith("block_") for p in path)
        if path[-1] in _LORA_LEAVES:
            n_lora += size
        elif in_block and path[-1] in _MATMUL_LEAVES:
            n_mat += size
    return {"n_mat": n_mat, "n_lora": n_lora}


def flops_per_token(
    n_mat: int, n_lora: int, n_layers: int, d_model: int, vocab: int, seq_len: int, mode: str
) -> dict[str, float]:
    """Training model FLOPs per token, split by term, for ``mode`` ``lora`` or ``full``."""
    attention = 6.0 * n_layers * seq_len * d_model
    if mode == "lora":
        weights = 4.0 * n_mat + 6.0 * n_lora
        output = 4.0 * d_model * vocab
    elif mode in ("full", "scratch"):
        weights = 6.0 * n_mat
        output = 6.0 * d_model * vocab
    else:
        raise ValueError(f"unknown mode {mode!r}")
    return {"weights": weights, "attention": attention, "output": output, "total": weights + attention + output}


def forward_flops_per_token(n_mat: int, n_layers: int, d_model: int, vocab: int, seq_len: int) -> float:
    """Forward-only model FLOPs per token (evaluation, decoding without a cache's savings)."""
    return 2.0 * n_mat + 2.0 * n_layers * seq_len * d_model + 2.0 * d_model * vocab
