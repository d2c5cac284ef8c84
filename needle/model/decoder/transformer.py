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
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from needle.config import LoraConfig, ModelConfig
from needle.hardware import GPU_BACKENDS, BackendSettings, settings_for
from needle.model.decoder.attention import blocked_attention, softcapped_attention
from needle.model.decoder.layers import LoraDense, RMSNorm
from needle.model.decoder.recompute import apply_recomputed
from needle.model.decoder.scan import (
    LAYERS, cast_matrices, layer_period, lookup_checkpoint_policy, resolve_remat, scan_blocks, scan_remat_policy,
    stack_block_params,
)
from needle.model.decoder.splash import splash_attention, splash_supported

# "auto" attention on a TPU takes splash for heads at least this wide, else the blocked path (Attention._splash).
SPLASH_MIN_HEAD_DIM = 128

# Short names of the projections as LoraConfig.targets spells them.
_TARGET_OF = {
    "q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o",
    "gate_proj": "gate", "up_proj": "up", "down_proj": "down",
}  # fmt: skip


def rope_inv_freq(cfg: ModelConfig, layer_type: str = "full_attention") -> np.ndarray | None:
    """Inverse RoPE frequencies ``[head_dim / 2]`` as Hugging Face computes them (float32).

    None for a native model, whose frequencies ``apply_rope`` derives from ``rope_theta`` as it
    always has (so native logits stay bit-identical). Sliding layers with ``rope_local_theta``
    use that base unscaled; every other layer uses ``rope_theta`` and ``rope_scaling``.
    """
    local = layer_type == "sliding_attention" and cfg.rope_local_theta is not None
    if cfg.arch == "needle" and cfg.rope_scaling is None and not local:
        return None
    theta = cfg.rope_local_theta if local else cfg.rope_theta
    dim = cfg.head_dim
    inv = 1.0 / (np.float32(theta) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)))
    rs = None if local else cfg.rope_scaling
    if rs is None:
        return inv.astype(np.float32)
    if rs.type == "linear":
        return (inv / np.float32(rs.factor)).astype(np.float32)
    # llama3: keep short wavelengths, divide long ones by factor, interpolate in between.
    low_wavelen = rs.original_max_len / rs.low_freq_factor
    high_wavelen = rs.original_max_len / rs.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / rs.factor, inv)
    smooth = (rs.original_max_len / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, theta: float, inv_freq: np.ndarray | None = None) -> jax.Array:
    """Rotate ``x[B, T, heads, head_dim]`` by its ``positions[B, T]`` (half-split RoPE).

    ``inv_freq`` (from :func:`rope_inv_freq`) overrides the frequencies derived from ``theta``.
    """
    half = x.shape[-1] // 2
    if inv_freq is None:
        freqs = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    else:
        freqs = jnp.asarray(inv_freq, jnp.float32)
    angles = positions.astype(jnp.float32)[:, :, None, None] * freqs  # [B, T, 1, half]
    sin, cos = jnp.sin(angles), jnp.cos(angles)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


class _Layer(nn.Module):
    """Shared fields of the attention and MLP sub-layers and their projection factory."""

    cfg: ModelConfig
    lora: LoraConfig | None
    settings: BackendSettings

    def proj(self, name: str, features: int, use_bias: bool = False) -> LoraDense:
        wants_lora = self.lora is not None and _TARGET_OF[name] in self.lora.targets
        return LoraDense(
            features,
            rank=self.lora.rank if wants_lora else 0,
            scale=self.lora.scale if wants_lora else 1.0,
            dtype=jnp.dtype(self.settings.compute_dtype),
            param_dtype=jnp.dtype(self.settings.param_dtype),
            use_bias=use_bias,
            name=name,
        )

    def norm(self, name: str) -> RMSNorm:
        s = self.settings
        return RMSNorm(self.cfg.norm_eps, jnp.dtype(s.compute_dtype), jnp.dtype(s.param_dtype), self.cfg.norm_offset_one, name=name)


class Attention(_Layer):
    """Grouped-query causal self-attention with RoPE, an optional sliding window and KV cache."""

    decode: bool = False
    layer_type: str = "full_attention"
    prefill: bool = False  # decode call with positions = arange(T): every visible slot is written now

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
        cfg = self.cfg
        b, t, _ = x.shape
        hd = cfg.head_dim
        q = self.proj("q_proj", cfg.n_heads * hd, cfg.qkv_bias)(x).reshape(b, t, cfg.n_heads, hd)
        k = self.proj("k_proj", cfg.n_kv_heads * hd, cfg.qkv_bias)(x).reshape(b, t, cfg.n_kv_heads, hd)
        v = self.proj("v_proj", cfg.n_kv_heads * hd, cfg.qkv_bias)(x).reshape(b, t, cfg.n_kv_heads, hd)
        if cfg.qk_norm:
            q, k = self.norm("q_norm")(q), self.norm("k_norm")(k)
        inv_freq = rope_inv_freq(cfg, self.layer_type)
        q = apply_rope(q, positions, cfg.rope_theta, inv_freq)
        k = apply_rope(k, positions, cfg.rope_theta, inv_freq)
        window = cfg.sliding_window if self.layer_type == "sliding_attention" else None
        if self.decode and self.has_variable("cache", "cached_key"):
            ck, cv, mask = self._update_cache(k, v, positions, window)
            if self.prefill and t > 1 and self.settings.attention != "dense":
                # Query p sees slots 0..p, all written by this call: attend to the new keys in
                # blocks rather than scoring the whole cache.
                out = self._attend(q, k, v, causal_window=window)
            else:
                out = self._attend(q, ck, cv, mask=mask)
        else:
            if self.decode:  # model.init(..., decode=True): only lay the cache out.
                self.variable("cache", "cached_key", jnp.zeros, k.shape, k.dtype)
                self.variable("cache", "cached_value", jnp.zeros, v.shape, v.dtype)
            out = self._attend(q, k, v, causal_window=window, segment_ids=segment_ids)
        return self.proj("o_proj", cfg.d_model, cfg.o_bias)(out.reshape(b, t, cfg.n_heads * hd))

    def _attend(
        self, q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None = None, causal_window: int | None = None,
        segment_ids: jax.Array | None = None,
    ) -> jax.Array:  # fmt: skip
        """Causal attention (``mask is None``), restricted to equal ``segment_ids`` (packed rows)
        when given, or attention under an explicit ``mask`` (decoding). ``settings.attention``
        picks the path: "dense" scores all ``[B, H, T, T]`` at once (the path before issue 20),
        "blocked" goes through needle/model/decoder/attention.py, "auto" takes cuDNN where it serves."""
        cfg = self.cfg
        scale = None if cfg.query_pre_attn_scalar is None else cfg.query_pre_attn_scalar**-0.5
        path = self.settings.attention
        if mask is None and path != "dense":
            if self._splash(q):
                on_tpu = jax.default_backend() == "tpu"  # "splash" asked for off a TPU: the Pallas interpreter
                return splash_attention(q, k, v, scale=scale, window=causal_window, softcap=cfg.attn_softcap,
                                        segment_ids=segment_ids, interpret=not on_tpu)  # fmt: skip
            fused = path == "auto" and cfg.attn_softcap is None and segment_ids is None and self._implementation(q)
            if fused:
                local = None if causal_window is None else (causal_window - 1, 0)
                return jax.nn.dot_product_attention(
                    q, k, v, scale=scale, is_causal=True, local_window_size=local, implementation="cudnn"
                )
            return blocked_attention(
                q, k, v, scale=scale, window=causal_window, softcap=cfg.attn_softcap, segment_ids=segment_ids,
                checkpoint=not self.settings.rematerialises,
            )
        segment_mask = None
        if segment_ids is not None:  # packed rows: attend within the row only
            segment_mask = segment_ids[:, None, :, None] == segment_ids[:, None, None, :]  # [B, 1, T, T]
        if cfg.attn_softcap is not None:
            return softcapped_attention(q, k, v, mask, causal_window, scale, cfg.attn_softcap, segment_mask)
        if mask is not None:
            # Decode shapes are tiny and need a per-row mask: the plain XLA path is fine.
            return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale)
        # A window of W positions, self included, reaches W - 1 positions back.
        local = None if causal_window is None else (causal_window - 1, 0)
        if segment_mask is not None:
            # The segment mask combines with the causal and window masks (XLA path).
            return jax.nn.dot_product_attention(
                q, k, v, mask=segment_mask, scale=scale, is_causal=True, local_window_size=local
            )
        return jax.nn.dot_product_attention(
            q, k, v, scale=scale, is_causal=True, local_window_size=local, implementation=self._implementation(q)
        )

    def _splash(self, q: jax.Array) -> bool:
        """Pallas splash attention: asked for ("splash"), or "auto" on a TPU for the shapes it takes."""
        s, (t, hd) = self.settings, (q.shape[1], q.shape[3])
        if s.attention == "splash":
            return True
        # Heads narrower than the kernel's 128 lanes run it at half width: on a TPU v5e the blocked
        # (tiled) path trained the 135M Llama shape (head_dim 64) at 16 x 1024 in 233 ms a LoRA step
        # against splash's 282 (full: 217 vs 270), while splash led at head_dim 128 (Qwen3-0.6B full:
        # 871 vs 980 ms) and 256 (Gemma 3 270M LoRA: 371 vs 381 ms), 2026-12-07.
        wide = hd >= SPLASH_MIN_HEAD_DIM
        return s.attention == "auto" and s.backend == "tpu" and jax.default_backend() == "tpu" and wide and splash_supported(t, hd)

    def _implementation(self, q: jax.Array) -> str | None:
        # cuDNN flash attention exists only on NVIDIA GPUs and only for half precision; GPU
        # settings may also be exercised on a CPU host (tests), which must take the XLA path.
        s = self.settings
        on_gpu = s.backend in GPU_BACKENDS and jax.default_backend() in GPU_BACKENDS
        fused = s.fused_attention and on_gpu and q.dtype in (jnp.bfloat16, jnp.float16)
        return "cudnn" if fused else None

    def _update_cache(
        self, k: jax.Array, v: jax.Array, positions: jax.Array, window: int | None = None
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Write k/v at each row's positions; return the whole cache and its visibility mask."""
        ck = self.variable("cache", "cached_key", jnp.zeros, k.shape, k.dtype)
        cv = self.variable("cache", "cached_value", jnp.zeros, v.shape, v.dtype)
        slots = jnp.arange(ck.value.shape[1])
        if k.shape[1] == 1 and self.settings.backend != "cpu":
            # One token a row: a select over the slots. An accelerator's scatter with per-row
            # indices serialises; reading and writing the cache once is bandwidth-bound instead.
            here = (slots[None, :] == positions[:, :1])[:, :, None, None]  # [B, S, 1, 1]
            ck.value = jnp.where(here, k.astype(ck.value.dtype), ck.value)
            cv.value = jnp.where(here, v.astype(cv.value.dtype), cv.value)
        else:
            rows = jnp.arange(k.shape[0])[:, None]
            ck.value = ck.value.at[rows, positions].set(k.astype(ck.value.dtype))
            cv.value = cv.value.at[rows, positions].set(v.astype(cv.value.dtype))
        # Slot s is visible to a query at position p iff s <= p: later slots hold prompt
        # padding or stale values until this row's own steps overwrite them.
        mask = slots[None, None, None, :] <= positions[:, None, :, None]  # [B, 1, T, max_len]
        if window is not None:
            mask &= slots[None, None, None, :] > positions[:, None, :, None] - window
        return ck.value.astype(k.dtype), cv.value.astype(v.dtype), mask


class Mlp(_Layer):
    """Gated MLP: ``(act(x·Wgate) * (x·Wup))·Wdown`` with act SiLU (or tanh-GELU for Gemma)."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        # Named for remat "mlp_saveable", which keeps them: the backward pass needs both.
        gate = checkpoint_name(self.proj("gate_proj", self.cfg.d_ff)(x), "mlp_gate")
        up = checkpoint_name(self.proj("up_proj", self.cfg.d_ff)(x), "mlp_up")
        act = nn.silu(gate) if self.cfg.mlp_act == "silu" else jax.nn.gelu(gate, approximate=True)
        return self.proj("down_proj", self.cfg.d_model)(act * up)


class Block(_Layer):
    """Pre-norm transformer block with float32 residual adds (and Gemma's post-norms)."""

    decode: bool = False
    layer_type: str = "full_attention"
    prefill: bool = False

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
        cfg, s = self.cfg, self.settings
        attn = Attention(cfg, self.lora, s, self.decode, self.layer_type, self.prefill, name="attn")
        h = attn(self.norm("attn_norm")(x), positions, segment_ids)
        if cfg.post_norms:
            h = self.norm("post_attn_norm")(h)
        x = checkpoint_name(x + h.astype(jnp.float32), "block_mid")  # the MLP norm's input, for "mlp_saveable"
        h = Mlp(cfg, self.lora, s, name="mlp")(self.norm("mlp_norm")(x))
        if cfg.post_norms:
            h = self.norm("post_mlp_norm")(h)
        return x + h.astype(jnp.float32)


class OutputKernel(nn.Module):
    """The untied output projection's weight ``lm_head/kernel [D, V]``, applied by the caller."""

    d_model: int
    vocab_size: int
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self) -> jax.Array:
        shape = (self.d_model, self.vocab_size)
        return self.param("kernel", nn.initializers.lecun_normal(), shape, self.param_dtype)


def remat_block(policy: str) -> type[Block]:
    """``Block`` under the named rematerialisation policy (needle/hardware.py's REMAT_POLICIES)."""
    if policy in ("none", "everything_saveable", "recompute"):  # recompute: apply_recomputed
        return Block
    if policy in ("everything", "nothing_saveable"):
        return nn.remat(Block)
    return nn.remat(Block, policy=lookup_checkpoint_policy(policy))


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
