"""The transformer's blocks as one ``lax.scan``: one compiled block instead of one per layer.

XLA compiles an unrolled stack of N blocks as N copies (a 30-layer 135M Llama compiled for over
two minutes on a TPU v5e); scanned, it compiles one body. Layers differ only by their attention
kind (Gemma 3: five sliding-window layers to one global), so the scan runs over the repeating
*period* of the layer pattern: a body of ``period`` blocks (each with its own static kind), run
``L / period`` times over parameters stacked per position in the period.

The parameters stay in the unrolled ``block_i`` layout that checkpoints, adapters and every export
read; :func:`stack_block_params` stacks them inside the step (matrices in the compute dtype, the
cast each projection makes anyway). The KV cache of a scanned model is stacked the same way.

    period = layer_period(cfg.resolved_layer_types())
    stacked = [stack_block_params([params[f"block_{g * period + j}"] for g in range(L // period)], dt)
               for j in range(period)]
    x, _ = scan_blocks(blocks, stacked, x, positions, segment_ids, jnp.float32, policy)

Used by needle/model/decoder/transformer.py (``BackendSettings.scan_layers``) and block.py (remat policies).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from needle.config import ModelConfig
from needle.model.decoder.splash import SPLASH_RESIDUALS


def device_memory_bytes() -> int | None:
    """The first device's memory (HBM on an accelerator); None where JAX does not say (the CPU)."""
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("bytes_limit")


# The share of the device memory beside the train state that remat "auto" lets kept activations
# take; the rest is for what the estimate leaves out: the loss chunk's logits and their gradient
# (1024 x 151,936 float32 is 0.6 GB, Gemma's 262k vocabulary 1 GB), one block's working set and
# XLA's own buffers. On a TPU v5e these choices ran (2026-12-07, under the dots policy that
# projections_saveable replaced: 135M LoRA at 16 x 1024 keeping every projection, 10.4 GB in all;
# Qwen3-0.6B LoRA keeping the MLP, 12.3 GB in all); compiled ahead of time, the 135M LoRA now
# needs 7.3 GiB. Not sharded: with fsdp each device holds a part of the state and the batch,
# which this estimate does not divide.
KEPT_SHARE = 0.6

# What the MLP keeps under "mlp_saveable" (checkpoint names set in needle/model/decoder/block.py).
MLP_SAVED_NAMES = ("block_mid", "mlp_gate", "mlp_up")
# What "projections_saveable" keeps: every projection's output, adapter included, and LoRA's x·A
# (checkpoint names set in needle/model/decoder/layers.py LoraDense), and the tiled attention's
# output and log-sum-exp (tiled.py, flash.py, with flash's tile table) or the splash kernel's
# (splash.py), so that attention's forward is not run again in the backward pass (135M Llama LoRA
# at 16 x 1024 compiled for a TPU v5e: XLA's estimate 445 -> 403 ms a step, 1.1 GiB more
# temporaries, 2026-12-07).
PROJECTION_SAVED_NAMES = ("proj_out", "lora_down", "attn_out", "attn_lse", "attn_tiles", SPLASH_RESIDUALS)


def count_model_params(cfg: ModelConfig) -> int:
    """Parameters of ``cfg``'s model (embedding, untied output layer, matrices; norms left out)."""
    attn = 2 * cfg.d_model * cfg.n_heads * cfg.head_dim + 2 * cfg.d_model * cfg.n_kv_heads * cfg.head_dim
    head = 0 if cfg.tie_embeddings else cfg.d_model * cfg.vocab_size
    return cfg.vocab_size * cfg.d_model + head + cfg.n_layers * (attn + 3 * cfg.d_model * cfg.d_ff)


def resolve_remat(policy: str, cfg: ModelConfig, tokens: int, *, trains_all: bool) -> str:
    """``policy``, with "auto" decided for a batch of ``tokens`` tokens: the policy keeping the most
    whose kept activations (all layers) take at most ``KEPT_SHARE`` of the device memory the
    train state leaves: "projections_saveable" (every projection's output, recompute the rest), else
    "mlp_saveable" (the MLP's gate and up outputs and the float32 residual before the MLP:
    recompute only the attention half), else "nothing_saveable" (each block's input only).

    The state: the frozen base in bfloat16 (2 bytes a parameter) for LoRA; float32 weights,
    gradients and two Adam moments (16 bytes a parameter) with ``trains_all`` (full fine-tuning).
    On a TPU v5e (15.75 GiB) the 135M Llama shape at 16 x 1024 keeps every projection (5.8 GiB),
    Qwen3-0.6B's LoRA the MLP (7.0 GiB of the 14.0 GiB every projection would take), its full
    fine-tuning nothing (8.9 GiB of state). Without a known device memory (the CPU): nothing_saveable.

    Not "dots_saveable": it also keeps attention's score einsums (dots with batch dimensions), so
    the blocked path's ``[B, K, G, block, T]`` float32 scores of every layer: the 135M Llama shape
    at 16 x 1024 needed 21.1 GB of temporaries that way on a TPU v5e (2026-12-06), out of HBM. Not
    "dots_with_no_batch_dims_saveable": under LoRA it keeps x·W and the adapter's (x·A)·B of every
    projection apart, twice the projections' memory (135M LoRA at 16 x 1024: 10.07 GiB of
    temporaries against full fine-tuning's 6.06, compiled for a TPU v5e ahead of time, 2026-12-07)."""
    if policy != "auto":
        return policy
    limit = device_memory_bytes()
    if limit is None:
        return "nothing_saveable"
    budget = KEPT_SHARE * (limit - count_model_params(cfg) * (16 if trains_all else 2))
    outputs = cfg.n_heads * cfg.head_dim + 2 * cfg.n_kv_heads * cfg.head_dim + 2 * cfg.d_model + 2 * cfg.d_ff
    per_token_layer = {
        # bf16 outputs of q, k, v, o, gate, up, down and the tiled attention's float32 output,
        # counted whether or not a batch takes the tiled path (LoRA's rank-wide x·A and the
        # log-sum-exp left out: < 2 %)
        "projections_saveable": 2 * outputs + 4 * cfg.n_heads * cfg.head_dim,
        "mlp_saveable": 2 * 2 * cfg.d_ff + 4 * cfg.d_model,  # bf16 gate and up, float32 residual
    }
    for name, width in per_token_layer.items():
        if width * tokens * cfg.n_layers <= budget:
            return name
    return "nothing_saveable"


def layer_period(kinds: list[str] | tuple[str, ...]) -> int:
    """Smallest ``p`` dividing ``len(kinds)`` with ``kinds[i] == kinds[i % p]`` (Gemma 3: 6, Llama: 1)."""
    n = len(kinds)
    for p in range(1, n + 1):
        if n % p == 0 and all(kinds[i] == kinds[i % p] for i in range(n)):
            return p
    return n


LAYERS = "layers"  # a params tree's key holding the blocks stacked: layers/<j>/... [L / period, ...]


def cast_matrices(tree: Any, dtype: Any) -> Any:
    """``tree`` with its matrices in ``dtype``; vectors (norm scales, biases) as stored.

    Every projection casts its kernel (and LoRA factors) to the compute dtype before use, while
    norm scales and biases are read in their own dtype: casting the matrices early changes no value.
    A matrix has two dimensions, three under ``layers`` (stacked blocks)."""

    def cast(path: tuple[Any, ...], x: Any) -> Any:
        stacked = any(getattr(k, "key", None) == LAYERS for k in path)
        return x.astype(dtype) if x.ndim >= 2 + stacked else x

    return jax.tree_util.tree_map_with_path(cast, tree)


def stack_layers(params: dict[str, Any], period: int, stack: Any = jnp.stack) -> dict[str, Any]:
    """``block_i`` subtrees moved to ``layers/<j>``, stacked on a new axis 0 (block ``g * period + j``
    at index ``g``); the rest of the tree as it is. A tree without blocks comes back unchanged.

    The train state of a scanned model keeps its blocks this way, so the optimizer, the finite
    check and the gradient see one leaf per kind of weight rather than one per layer (a 30-layer
    LoRA: 14 leaves instead of 420), and nothing is stacked inside the step."""
    blocks = [k for k in params if k.startswith("block_")]
    if not blocks:
        return params
    if len(blocks) % period:
        raise ValueError(f"{len(blocks)} blocks do not divide into a layer period of {period}")
    groups = len(blocks) // period
    out = {k: v for k, v in params.items() if not k.startswith("block_")}
    out[LAYERS] = {
        str(j): jax.tree.map(lambda *xs: stack(xs), *[params[f"block_{g * period + j}"] for g in range(groups)])
        for j in range(period)
    }  # fmt: skip
    return out


def stack_model_layers(params: dict[str, Any], cfg: ModelConfig, stack: Any = jnp.stack) -> dict[str, Any]:
    """``stack_layers`` over ``cfg``'s layer period: the layout a scanned model's train state and
    decoding read (``needle.train.run.build_state``, ``needle.eval.decode.decoding_params``);
    ``stack=np.stack`` stacks host arrays on the host."""
    return stack_layers(params, layer_period(cfg.resolved_layer_types()), stack)


def unstack_layers(params: dict[str, Any]) -> dict[str, Any]:
    """Inverse of :func:`stack_layers`: the ``block_i`` layout that checkpoints and exports read."""
    if not isinstance(params, dict) or LAYERS not in params:
        return params
    out = {k: v for k, v in params.items() if k != LAYERS}
    period = len(params[LAYERS])
    for j, sub in params[LAYERS].items():
        for g in range(jax.tree.leaves(sub)[0].shape[0]):
            out[f"block_{g * period + int(j)}"] = jax.tree.map(lambda x, g=g: x[g], sub)
    return out


def map_param_trees(fn: Any, tree: Any, params: Any) -> Any:
    """``fn`` applied to every subtree of ``tree`` shaped like ``params`` (an optimizer state's moments)."""
    shape = jax.tree.structure(params)
    is_params = lambda x: jax.tree.structure(x) == shape  # noqa: E731
    return jax.tree.map(lambda t: fn(t) if is_params(t) else t, tree, is_leaf=is_params)


def stack_block_params(blocks: list[Any], dtype: Any) -> Any:
    """Per-block parameter trees stacked leaf by leaf on a new axis 0, matrices in ``dtype``."""
    return jax.tree.map(lambda *leaves: jnp.stack(leaves), *[cast_matrices(b, dtype) for b in blocks])


def scan_remat_policy(policy: str) -> Any:
    """The ``jax.checkpoint`` policy of the scanned body for a REMAT_POLICIES name (None: no remat).

    Inside a scan the body is a loop iteration, so XLA cannot merge recomputation back into the
    forward pass: "recompute" (the unrolled CPU path's custom VJP) is plain nothing_saveable here."""
    if policy in ("none", "everything_saveable"):
        return None
    if policy in ("everything", "nothing_saveable", "recompute"):
        return jax.checkpoint_policies.nothing_saveable
    return lookup_checkpoint_policy(policy)


def lookup_checkpoint_policy(policy: str) -> Any:
    """The ``jax.checkpoint_policies`` member a remat policy name stands for ("mlp_saveable",
    "projections_saveable": the activations named in the model)."""
    if policy == "mlp_saveable":
        return jax.checkpoint_policies.save_only_these_names(*MLP_SAVED_NAMES)
    if policy == "projections_saveable":
        return jax.checkpoint_policies.save_only_these_names(*PROJECTION_SAVED_NAMES)
    return getattr(jax.checkpoint_policies, policy)


def scan_blocks(
    blocks: list[nn.Module], stacked: list[Any], x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None,
    residual_dtype: Any, policy: Any, cache: dict[str, Any] | None = None,
) -> tuple[jax.Array, dict[str, Any] | None]:  # fmt: skip
    """Run the unbound ``blocks`` (one period) over ``stacked`` parameters, the residual stream
    ``x`` as the carry in ``residual_dtype``; ``policy`` (a ``jax.checkpoint`` policy, or None)
    rematerialises the body. With ``cache`` (``{"<j>": stacked cache of block j}``) the blocks
    decode and the updated cache is returned as well."""
    x = x.astype(residual_dtype)
    if cache is not None:
        def step(h: jax.Array, xs: Any) -> tuple[jax.Array, list[Any]]:
            group_params, group_cache = xs
            new_cache = []
            for j, blk in enumerate(blocks):
                variables = {"params": group_params[j], "cache": group_cache[j]}
                h, upd = blk.apply(variables, h, positions, mutable=["cache"])
                h = h.astype(residual_dtype)
                new_cache.append(upd["cache"])
            return h, new_cache

        x, new = jax.lax.scan(step, x, (stacked, [cache[str(j)] for j in range(len(blocks))]))
        return x, {str(j): c for j, c in enumerate(new)}

    def body(h: jax.Array, group_params: Any) -> tuple[jax.Array, None]:
        for j, blk in enumerate(blocks):
            h = blk.apply({"params": group_params[j]}, h, positions, segment_ids).astype(residual_dtype)
        return h, None

    if policy is not None:
        body = jax.checkpoint(body, policy=policy, prevent_cse=False)
    x, _ = jax.lax.scan(body, x, stacked)
    return x, None
