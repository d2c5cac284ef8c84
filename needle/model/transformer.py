"""Decoder-only transformer (Flax linen) with optional LoRA adapters and a KV cache.

Each block is RMSNorm -> grouped-query causal self-attention with RoPE -> residual, then
RMSNorm -> gated MLP ``(SiLU(x·Wgate) * (x·Wup))·Wdown`` -> residual. A final RMSNorm and an
output projection (the transposed embedding when ``cfg.tie_embeddings``) give float32 logits.

    from needle.config import model_preset
    from needle.model.transformer import Transformer
    model = Transformer(model_preset("tiny"))            # settings default: settings_for("cpu")
    params = model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
    logits = model.apply({"params": params}, tokens)     # float32[B, T, V]

Parameter tree (no biases anywhere)::

    embed/embedding [V, D]            final_norm/scale [D]          lm_head/kernel [D, V] (untied only)
    block_i/attn_norm/scale, block_i/mlp_norm/scale
    block_i/attn/{q_proj,k_proj,v_proj,o_proj}/kernel
    block_i/mlp/{gate_proj,up_proj,down_proj}/kernel
    .../<proj>/lora_a [in, r], .../<proj>/lora_b [r, out]   (only for projections in lora.targets)

Master weights are ``settings.param_dtype`` (float32); activations and matmuls run in
``settings.compute_dtype``; the residual stream, norms, RoPE and softmax stay in float32.

Cached decoding (used by needle/eval/decode.py)
-----------------------------------------------
The cache lives in the ``"cache"`` collection: per block ``attn/cached_key`` and
``attn/cached_value``, each ``[B, max_len, n_kv_heads, head_dim]`` in the compute dtype. There is
no cache index: **the positions you pass are the cache slots**. A call with ``decode=True``
writes token ``t`` of row ``b`` into slot ``positions[b, t]`` and lets it attend to every slot
``<= positions[b, t]`` of its own row. So:

1. ``cache = init_cache(model, B, max_len)`` (zeros; or
   ``model.init(rng, jnp.zeros((B, max_len), jnp.int32), decode=True)["cache"]``, which only lays
   the cache out and writes nothing).
2. Prefill: right-pad the prompts to one bucket length ``T <= max_len`` (any pad id) and call
   ``logits, upd = model.apply({"params": p, "cache": cache}, prompts, positions, decode=True,
   mutable=["cache"])`` with ``positions = arange(T)`` for every row (``positions=None`` means
   exactly that). Row ``b`` with ``n_b`` real tokens reads its next-token logits at
   ``logits[b, n_b - 1]``. Its padding was written into slots ``n_b..T-1``; that is harmless
   because those slots are masked until overwritten (step 3 writes slot ``n_b`` first).
3. Steps: feed one token per row, ``tokens[B, 1]`` with ``positions[b, 0] = n_b + i`` at step
   ``i`` (the slot of the token being fed), cache ``upd["cache"]``; the next-token logits are
   ``logits[:, 0]``. Rows advance independently; a finished row may keep being fed anything.

Positions must stay below the cache's ``max_len``: out-of-range writes are dropped by XLA (no
error is possible inside jit), so the decoder must cap ``n_b + max_new_tokens`` at ``max_len``.
Without ``decode`` the model is plain causal attention over the given tokens (right padding
after the real tokens therefore never affects them); ``positions`` only feed RoPE.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from needle.config import LoraConfig, ModelConfig
from needle.hardware import GPU_BACKENDS, BackendSettings, settings_for

# Short names of the projections as LoraConfig.targets spells them.
_TARGET_OF = {
    "q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o",
    "gate_proj": "gate", "up_proj": "up", "down_proj": "down",
}  # fmt: skip


class LoraDense(nn.Module):
    """Bias-free ``y = x·W + scale·((x·A)·B)``; ``rank == 0`` means a plain dense layer.

    B starts at zero so a fresh adapter leaves the layer unchanged; W + A·B is never formed,
    which keeps the adapter path cheap and gradients flowing only where they should.
    """

    features: int
    rank: int = 0
    scale: float = 1.0
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        d_in = x.shape[-1]
        kernel = self.param("kernel", nn.initializers.lecun_normal(), (d_in, self.features), self.param_dtype)
        x = x.astype(self.dtype)
        y = jnp.dot(x, kernel.astype(self.dtype))
        if self.rank:
            a = self.param("lora_a", nn.initializers.normal(d_in**-0.5), (d_in, self.rank), self.param_dtype)
            b = self.param("lora_b", nn.initializers.zeros_init(), (self.rank, self.features), self.param_dtype)
            y = y + self.scale * jnp.dot(jnp.dot(x, a.astype(self.dtype)), b.astype(self.dtype))
        return y


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale, computed in float32."""

    eps: float
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param("scale", nn.initializers.ones_init(), (x.shape[-1],), self.param_dtype)
        x = x.astype(jnp.float32)
        y = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + self.eps)
        return (y * scale.astype(jnp.float32)).astype(self.dtype)


def apply_rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotate ``x[B, T, heads, head_dim]`` by its ``positions[B, T]`` (half-split RoPE)."""
    half = x.shape[-1] // 2
    freqs = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
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

    def proj(self, name: str, features: int) -> LoraDense:
        wants_lora = self.lora is not None and _TARGET_OF[name] in self.lora.targets
        return LoraDense(
            features,
            rank=self.lora.rank if wants_lora else 0,
            scale=self.lora.scale if wants_lora else 1.0,
            dtype=jnp.dtype(self.settings.compute_dtype),
            param_dtype=jnp.dtype(self.settings.param_dtype),
            name=name,
        )


class Attention(_Layer):
    """Grouped-query causal self-attention with RoPE and an optional KV cache."""

    decode: bool = False

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        cfg = self.cfg
        b, t, _ = x.shape
        hd = cfg.head_dim
        q = self.proj("q_proj", cfg.n_heads * hd)(x).reshape(b, t, cfg.n_heads, hd)
        k = self.proj("k_proj", cfg.n_kv_heads * hd)(x).reshape(b, t, cfg.n_kv_heads, hd)
        v = self.proj("v_proj", cfg.n_kv_heads * hd)(x).reshape(b, t, cfg.n_kv_heads, hd)
        q = apply_rope(q, positions, cfg.rope_theta)
        k = apply_rope(k, positions, cfg.rope_theta)
        if self.decode and self.has_variable("cache", "cached_key"):
            k, v, mask = self._update_cache(k, v, positions)
            # Decode shapes are tiny and need a per-row mask: the plain XLA path is fine.
            out = jax.nn.dot_product_attention(q, k, v, mask=mask)
        else:
            if self.decode:  # model.init(..., decode=True): only lay the cache out.
                self.variable("cache", "cached_key", jnp.zeros, k.shape, k.dtype)
                self.variable("cache", "cached_value", jnp.zeros, v.shape, v.dtype)
            out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=self._implementation(q))
        return self.proj("o_proj", cfg.d_model)(out.reshape(b, t, cfg.n_heads * hd))

    def _implementation(self, q: jax.Array) -> str | None:
        # cuDNN flash attention exists only on NVIDIA GPUs and only for half precision; GPU
        # settings may also be exercised on a CPU host (tests), which must take the XLA path.
        s = self.settings
        on_gpu = s.backend in GPU_BACKENDS and jax.default_backend() in GPU_BACKENDS
        fused = s.fused_attention and on_gpu and q.dtype in (jnp.bfloat16, jnp.float16)
        return "cudnn" if fused else None

    def _update_cache(
        self, k: jax.Array, v: jax.Array, positions: jax.Array
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Write k/v at each row's positions; return the whole cache and its visibility mask."""
        ck = self.variable("cache", "cached_key", jnp.zeros, k.shape, k.dtype)
        cv = self.variable("cache", "cached_value", jnp.zeros, v.shape, v.dtype)
        rows = jnp.arange(k.shape[0])[:, None]
        ck.value = ck.value.at[rows, positions].set(k.astype(ck.value.dtype))
        cv.value = cv.value.at[rows, positions].set(v.astype(cv.value.dtype))
        slots = jnp.arange(ck.value.shape[1])
        # Slot s is visible to a query at position p iff s <= p: later slots hold prompt
        # padding or stale values until this row's own steps overwrite them.
        mask = slots[None, None, None, :] <= positions[:, None, :, None]  # [B, 1, T, max_len]
        return ck.value.astype(k.dtype), cv.value.astype(v.dtype), mask


class Mlp(_Layer):
    """Gated MLP: ``(SiLU(x·Wgate) * (x·Wup))·Wdown``."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        gate = self.proj("gate_proj", self.cfg.d_ff)(x)
        up = self.proj("up_proj", self.cfg.d_ff)(x)
        return self.proj("down_proj", self.cfg.d_model)(nn.silu(gate) * up)


class Block(_Layer):
    """Pre-norm transformer block with float32 residual adds."""

    decode: bool = False

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        cfg, s = self.cfg, self.settings
        dt, pdt = jnp.dtype(s.compute_dtype), jnp.dtype(s.param_dtype)
        h = RMSNorm(cfg.norm_eps, dt, pdt, name="attn_norm")(x)
        x = x + Attention(cfg, self.lora, s, self.decode, name="attn")(h, positions).astype(jnp.float32)
        h = RMSNorm(cfg.norm_eps, dt, pdt, name="mlp_norm")(x)
        return x + Mlp(cfg, self.lora, s, name="mlp")(h).astype(jnp.float32)


class OutputKernel(nn.Module):
    """The untied output projection's weight ``lm_head/kernel [D, V]``, applied by the caller."""

    d_model: int
    vocab_size: int
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self) -> jax.Array:
        shape = (self.d_model, self.vocab_size)
        return self.param("kernel", nn.initializers.lecun_normal(), shape, self.param_dtype)


class Transformer(nn.Module):
    """The decoder: ``__call__(tokens[B,T], positions[B,T] | None, decode) -> float32[B,T,V]``."""

    cfg: ModelConfig
    lora: LoraConfig | None = None
    settings: BackendSettings | None = None

    @nn.compact
    def __call__(self, tokens: jax.Array, positions: jax.Array | None = None, decode: bool = False) -> jax.Array:
        cfg = self.cfg
        s = self.settings or settings_for("cpu")
        if s.scan_layers:
            raise ValueError(
                "BackendSettings.scan_layers=True is not supported: the parameter layout is fixed to "
                "unrolled block_0..block_N (see docs/architecture.md)"
            )
        if tokens.ndim != 2:
            raise ValueError(f"tokens must be int32[B, T], got shape {tokens.shape}")
        b, t = tokens.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        elif positions.shape != tokens.shape:
            raise ValueError(f"positions shape {positions.shape} differs from tokens shape {tokens.shape}")
        dt, pdt = jnp.dtype(s.compute_dtype), jnp.dtype(s.param_dtype)
        # Lookups stay in the master dtype: the residual stream is float32.
        embed = nn.Embed(
            cfg.vocab_size, cfg.d_model, embedding_init=nn.initializers.normal(cfg.d_model**-0.5),
            dtype=pdt, param_dtype=pdt, name="embed",
        )  # fmt: skip
        x = embed(tokens).astype(jnp.float32)
        block = nn.remat(Block) if s.remat else Block
        for i in range(cfg.n_layers):
            x = block(cfg, self.lora, s, decode, name=f"block_{i}")(x, positions)
        x = RMSNorm(cfg.norm_eps, dt, pdt, name="final_norm")(x)
        if cfg.tie_embeddings:
            w = embed.embedding.T
        else:
            w = OutputKernel(cfg.d_model, cfg.vocab_size, pdt, name="lm_head")()
        return jnp.einsum("btd,dv->btv", x, w.astype(dt), preferred_element_type=jnp.float32)


def init_cache(model: Transformer, batch_size: int, max_len: int) -> dict[str, Any]:
    """Return a zero KV cache for ``batch_size`` rows of up to ``max_len`` tokens (no params built)."""
    if batch_size <= 0 or max_len <= 0:
        raise ValueError(f"init_cache needs batch_size > 0 and max_len > 0, got {batch_size}, {max_len}")
    tokens = jnp.zeros((batch_size, max_len), jnp.int32)
    shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), tokens, decode=True)["cache"])
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
