"""Decoder-only transformer (Flax linen) with optional LoRA adapters and a KV cache.

Each block is RMSNorm -> grouped-query causal self-attention with RoPE -> residual, then
RMSNorm -> gated MLP ``(SiLU(x·Wgate) * (x·Wup))·Wdown`` -> residual. A final RMSNorm and an
output projection (the transposed embedding when ``cfg.tie_embeddings``) give float32 logits.

    from needle.config import model_preset
    from needle.model.decoder.transformer import Transformer
    model = Transformer(model_preset("tiny"))            # settings default: settings_for("cpu")
    params = model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
    logits = model.apply({"params": params}, tokens)     # float32[B, T, V]

Parameter tree of a native model (no biases anywhere)::

    embed/embedding [V, D]            final_norm/scale [D]          lm_head/kernel [D, V] (untied only)
    block_i/attn_norm/scale, block_i/mlp_norm/scale
    block_i/attn/{q_proj,k_proj,v_proj,o_proj}/kernel
    block_i/mlp/{gate_proj,up_proj,down_proj}/kernel
    .../<proj>/lora_a [in, r], .../<proj>/lora_b [r, out]   (only for projections in lora.targets)

The Hugging Face switches of ``ModelConfig`` (see needle/config.py) only add leaves:
``block_i/attn/{q,k,v}_proj/bias`` (``qkv_bias``), ``block_i/attn/o_proj/bias`` (``o_bias``),
``block_i/attn/{q_norm,k_norm}/scale [head_dim]`` (``qk_norm``) and
``block_i/{post_attn_norm,post_mlp_norm}/scale`` (``post_norms``). With ``norm_offset_one`` a
norm's ``scale`` holds Gemma's raw ``w`` (the layer multiplies by ``1 + w``), so imported
weights are stored exactly as the checkpoint has them. Sliding-window layers (``layer_types``)
see only the last ``sliding_window`` positions, in the full forward and in the cache.

Master weights are ``settings.param_dtype`` (float32); activations and matmuls run in
``settings.compute_dtype``; the residual stream, norms, RoPE and softmax stay in float32.

Cached decoding (used by needle/eval/decode.py)
-----------------------------------------------
The cache lives in the ``"cache"`` collection: per block ``attn/cached_key`` and
``attn/cached_value``, each ``[B, max_len, n_kv_heads, head_dim]`` in the compute dtype (scanned
layers: stacked, ``layers/<j>/attn/...`` with a leading ``[L / period]`` axis). There is no cache
index: **the positions you pass are the cache slots**. A call with ``decode=True`` writes token
``t`` of row ``b`` into slot ``positions[b, t]`` and lets it attend to every slot ``<=
positions[b, t]`` of its own row. So:

1. ``cache = init_cache(model, B, max_len)`` (zeros).
2. Prefill: right-pad the prompts to one bucket length ``T <= max_len`` and call ``logits, upd =
   model.apply({"params": p, "cache": cache}, prompts, None, decode=True, mutable=["cache"])``
   (``positions=None``: ``arange(T)`` for every row). Row ``b`` with ``n_b`` real tokens reads its
   next-token logits at ``logits[b, n_b - 1]``; its padding in slots ``n_b..T-1`` stays masked
   until overwritten (step 3 writes slot ``n_b`` first).
3. Steps: feed ``tokens[B, 1]`` with ``positions[b, 0] = n_b + i`` at step ``i`` and the cache
   ``upd["cache"]``; the next-token logits are ``logits[:, 0]``. Rows advance independently.

Positions must stay below the cache's ``max_len``: out-of-range writes are dropped (no error is
possible inside jit), so the decoder caps ``n_b + max_new_tokens`` at ``max_len``. Without
``decode`` the model is plain causal attention over the given tokens; ``positions`` feed RoPE.

Packed sequences (training)
---------------------------
``segment_ids[B, T]`` (int, without ``decode``) packs several rows into one sequence: a token
attends only to earlier tokens of its own segment (equal id; padding shares id 0 and attends
to padding only), sliding windows included, and the caller restarts ``positions`` at 0 for
each row, so every packed row computes exactly the logits it would alone.
"""

from __future__ import annotations

import functools
from typing import Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp

from needle.config import LoraConfig, ModelConfig
from needle.hardware import BackendSettings, settings_for
from needle.model.decoder.block import Block, remat_block
from needle.model.decoder.layers import RMSNorm
from needle.model.decoder.recompute import apply_recomputed
from needle.model.decoder.scan import (
    LAYERS, cast_matrices, layer_period, resolve_remat, scan_blocks, scan_remat_policy, stack_block_params,
)


class OutputKernel(nn.Module):
    """The untied output projection's weight ``lm_head/kernel [D, V]``, applied by the caller."""

    d_model: int
    vocab_size: int
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self) -> jax.Array:
        shape = (self.d_model, self.vocab_size)
        return self.param("kernel", nn.initializers.lecun_normal(), shape, self.param_dtype)


def checked_positions(tokens: jax.Array, positions: jax.Array | None, segment_ids: jax.Array | None,
                      decode: bool) -> jax.Array:  # fmt: skip
    """The call contract's checks on a model's inputs (this module's and Needle 3's): tokens
    ``int32[B, T]``, positions and segment ids of their shape, no segment ids when decoding. Returns
    the positions, ``0..T-1`` on every row when none are given."""
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be int32[B, T], got shape {tokens.shape}")
    b, t = tokens.shape
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    elif positions.shape != tokens.shape:
        raise ValueError(f"positions shape {positions.shape} differs from tokens shape {tokens.shape}")
    if segment_ids is not None and (decode or segment_ids.shape != tokens.shape):
        raise ValueError(f"segment_ids need tokens' shape {tokens.shape} and no decode, got {segment_ids.shape}")
    return positions


def output_logits(cfg: ModelConfig, dtype: Any, x: jax.Array, w: jax.Array) -> jax.Array:
    """Float32 logits ``[..., V]`` of final hidden states ``x[..., D]`` through ``w[D, V]`` (soft cap applied)."""
    logits = jnp.einsum("...d,dv->...v", x.astype(dtype), w.astype(dtype), preferred_element_type=jnp.float32)
    if cfg.final_softcap is not None:
        logits = cfg.final_softcap * jnp.tanh(logits / cfg.final_softcap)
    return logits


class Transformer(nn.Module):
    """The decoder: ``__call__(tokens[B,T], positions[B,T] | None, decode, segment_ids[B,T] | None) -> float32[B,T,V]``.

    ``return_hidden=True`` returns the final hidden states ``[B, T, D]`` (after the final norm,
    compute dtype) instead of logits; ``apply(variables, hidden, method="logits")`` maps any
    ``[..., D]`` of them to float32 logits ``[..., V]``. Together they let the loss
    (needle/train/loss.py) and prefill (needle/eval/decode.py) form logits only where needed.
    """

    cfg: ModelConfig
    lora: LoraConfig | None = None
    settings: BackendSettings | None = None
    # The top-level params ``logits`` reads (the chunked loss differentiates only these through it).
    head_names: ClassVar[tuple[str, ...]] = ("embed", "lm_head")

    def logits(self, hidden: jax.Array) -> jax.Array:
        """Float32 logits ``[..., V]`` of final hidden states ``[..., D]`` (output layer, soft cap)."""
        s = self.settings or settings_for("cpu")
        params = self.variables["params"]
        w = params["embed"]["embedding"].T if self.cfg.tie_embeddings else params["lm_head"]["kernel"]
        return output_logits(self.cfg, jnp.dtype(s.compute_dtype), hidden, w)

    @nn.compact
    def __call__(
        self, tokens: jax.Array, positions: jax.Array | None = None, decode: bool = False,
        segment_ids: jax.Array | None = None, return_hidden: bool = False,
    ) -> jax.Array:  # fmt: skip
        cfg = self.cfg
        s = self.settings or settings_for("cpu")
        prefill = decode and positions is None
        positions = checked_positions(tokens, positions, segment_ids, decode)
        b, t = tokens.shape
        dt, pdt = jnp.dtype(s.compute_dtype), jnp.dtype(s.param_dtype)
        # Lookups stay in the master dtype: the residual stream is float32.
        embed = nn.Embed(
            cfg.vocab_size, cfg.d_model, embedding_init=nn.initializers.normal(cfg.d_model**-0.5),
            dtype=pdt, param_dtype=pdt, name="embed",
        )  # fmt: skip
        x = embed(tokens).astype(jnp.float32)
        if cfg.embed_scale:
            # Gemma multiplies by sqrt(d) rounded to the weights' dtype; here the compute dtype.
            x = x * jnp.asarray(cfg.d_model**0.5, dt).astype(jnp.float32)
        if s.scan_layers:
            x = self._scanned_layers(x, positions, segment_ids, decode, prefill, s)
        else:
            # Remat only matters under differentiation; decoding keeps the plain block.
            block = Block if decode else remat_block(resolve_remat(s.remat, cfg, b * t, trains_all=self.lora is None))
            recompute = not decode and s.remat == "recompute" and not self.is_initializing()
            rdt = jnp.dtype(s.residual_dtype)
            for i, kind in enumerate(cfg.resolved_layer_types()):
                layer = block(cfg, self.lora, s, decode, kind, prefill, name=f"block_{i}")
                x = apply_recomputed(layer, x, positions, segment_ids) if recompute else layer(x, positions, segment_ids)
                x = x.astype(rdt)
        x = RMSNorm(cfg.norm_eps, dt, pdt, cfg.norm_offset_one, name="final_norm")(x)
        if cfg.tie_embeddings:
            w = embed.embedding.T
        else:
            w = OutputKernel(cfg.d_model, cfg.vocab_size, pdt, name="lm_head")()
        if return_hidden:
            return x
        return output_logits(cfg, dt, x, w)


    def _scanned_layers(
        self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None, decode: bool, prefill: bool,
        s: BackendSettings,
    ) -> jax.Array:  # fmt: skip
        """The blocks as one ``lax.scan`` over the repeating period of the layer pattern.

        The parameters keep their unrolled ``block_i`` layout (checkpoints, adapters and every
        export read it); here they are stacked, matrices already cast to the compute dtype (the
        cast each projection makes anyway, so the values are the same), into ``[L / period, ...]``
        per position in the period, and one compiled body of ``period`` blocks runs ``L / period``
        times. The KV cache is kept stacked the same way (``cache/layers/<j>/attn/...``).
        """
        cfg, lora = self.cfg, self.lora
        kinds = cfg.resolved_layer_types()
        period = layer_period(kinds)
        groups = len(kinds) // period
        dt, rdt = jnp.dtype(s.compute_dtype), jnp.dtype(s.residual_dtype)
        x = x.astype(rdt)  # the scan's carry: the residual stream between blocks
        if self.is_initializing():
            # Lay the parameters out exactly as the unrolled model does; decode caches stacked.
            for i, kind in enumerate(kinds):
                x = Block(cfg, lora, s, False, kind, False, name=f"block_{i}")(x, positions, segment_ids)
            if decode:
                b, t = positions.shape
                shape = (groups, b, t, cfg.n_kv_heads, cfg.head_dim)
                zeros = {str(j): {"attn": {"cached_key": jnp.zeros(shape, dt), "cached_value": jnp.zeros(shape, dt)}}
                         for j in range(period)}  # fmt: skip
                self.variable("cache", "layers", lambda: zeros)
            return x
        params = self.variables["params"]
        if LAYERS in params:  # kept stacked (a scanned train state: needle/model/decoder/scan.py stack_layers)
            layers = cast_matrices({LAYERS: params[LAYERS]}, dt)[LAYERS]
            stacked = [layers[str(j)] for j in range(period)]
        else:
            stacked = [stack_block_params([params[f"block_{g * period + j}"] for g in range(groups)], dt)
                       for j in range(period)]  # fmt: skip
        blocks = [Block(cfg, lora, s, decode, kinds[j], prefill, parent=None) for j in range(period)]
        if decode:
            cache = self.get_variable("cache", "layers")
            x, new_cache = scan_blocks(blocks, stacked, x, positions, None, rdt, None, cache)
            self.put_variable("cache", "layers", new_cache)
            return x
        policy = scan_remat_policy(resolve_remat(s.remat, cfg, x.shape[0] * x.shape[1], trains_all=lora is None))
        x, _ = scan_blocks(blocks, stacked, x, positions, segment_ids, rdt, policy)
        return x


def init_cache(model: Transformer, batch_size: int, max_len: int) -> dict[str, Any]:
    """Return a zero KV cache for ``batch_size`` rows of up to ``max_len`` tokens (no params built)."""
    if batch_size <= 0 or max_len <= 0:
        raise ValueError(f"init_cache needs batch_size > 0 and max_len > 0, got {batch_size}, {max_len}")
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), _trace_cache_shapes(model, batch_size, max_len))


@functools.lru_cache(maxsize=32)
def _trace_cache_shapes(model: Transformer, batch_size: int, max_len: int) -> Any:
    """The cache's shapes, traced once per model and size: tracing the model's init took 0.16 s of
    every decoding call on the 2-core CPU (135M shape, two layers), more than the prefill's share."""
    tokens = jax.ShapeDtypeStruct((batch_size, max_len), jnp.int32)
    return jax.eval_shape(lambda t: model.init(jax.random.key(0), t, decode=True)["cache"], tokens)
