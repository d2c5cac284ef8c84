"""The transformer's layers: RoPE, grouped-query attention (with its KV cache), the gated MLP and
the pre-norm block, and the block under a remat policy. needle/model/decoder/transformer.py
stacks them into the decoder (its docstring has the parameter tree and the cache contract).

    attn = Attention(cfg, lora, settings, decode=False, layer_type="full_attention", name="attn")
    block = remat_block("nothing_saveable")(cfg, lora, settings, name="block_0")
    x = block(x, positions, segment_ids)                  # float32 residual stream [B, T, D]

Attention picks its kernel per backend (``settings.attention``): Pallas splash on a TPU for heads
of ``SPLASH_MIN_HEAD_DIM`` or wider, cuDNN on NVIDIA GPUs, the blocked/tiled XLA path otherwise;
"flash" (needle/model/decoder/flash.py) only when asked for.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from needle.config import LoraConfig, ModelConfig
from needle.hardware import GPU_BACKENDS, SPLASH_MIN_HEAD_DIM, BackendSettings
from needle.model.decoder.attention import blocked_attention, softcapped_attention
from needle.model.decoder.flash import flash_attention, flash_supported
from needle.model.decoder.layers import LoraDense, RMSNorm
from needle.model.decoder.scan import lookup_checkpoint_policy
from needle.model.decoder.splash import splash_attention, splash_supported

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

    def proj(self, name: str, features: int, use_bias: bool = False, heads: int = 0) -> LoraDense:
        wants_lora = self.lora is not None and _TARGET_OF[name] in self.lora.targets
        return LoraDense(
            features,
            rank=self.lora.rank if wants_lora else 0,
            scale=self.lora.scale if wants_lora else 1.0,
            dtype=jnp.dtype(self.settings.compute_dtype),
            param_dtype=jnp.dtype(self.settings.param_dtype),
            use_bias=use_bias,
            order_grads=self.settings.backend == "cpu",
            # Off the CPU, q/k/v's matmuls (adapter too) write the heads layout themselves: on a TPU
            # v5e the flat LoRA output was summed in float32 and copied twice into that layout per
            # projection (Qwen3-0.6B LoRA at 16 x 1024, compiled ahead of time, 2026-12-07: XLA's
            # estimate 1288 -> 1045 ms a step). The CPU keeps the flat form, its gradients bit for bit.
            heads=heads if self.settings.backend != "cpu" else 0,
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
        q = self.proj("q_proj", cfg.n_heads * hd, cfg.qkv_bias, cfg.n_heads)(x).reshape(b, t, cfg.n_heads, hd)
        k = self.proj("k_proj", cfg.n_kv_heads * hd, cfg.qkv_bias, cfg.n_kv_heads)(x).reshape(b, t, cfg.n_kv_heads, hd)
        v = self.proj("v_proj", cfg.n_kv_heads * hd, cfg.qkv_bias, cfg.n_kv_heads)(x).reshape(b, t, cfg.n_kv_heads, hd)
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
            interpret = jax.default_backend() != "tpu"  # a Pallas kernel asked for off a TPU: its interpreter
            if path == "flash" and self._flash(q, causal_window):
                return flash_attention(q, k, v, segment_ids, scale=scale, interpret=interpret)
            if self._splash(q):
                return splash_attention(q, k, v, scale=scale, window=causal_window, softcap=cfg.attn_softcap,
                                        segment_ids=segment_ids, interpret=interpret)  # fmt: skip
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

    def _flash(self, q: jax.Array, window: int | None) -> bool:
        """Whether "flash" takes this layer: it has no sliding window or soft cap (the kernel has
        neither: an error, not a silent other path) and the shape suits it (init's dummy tokens do not)."""
        if window is not None or self.cfg.attn_softcap is not None:
            raise ValueError("attention='flash' has no sliding window or soft cap: this model needs "
                             "'splash', 'blocked' or 'auto'")  # fmt: skip
        initializing = self.scope is not None and self.is_initializing()
        return not initializing or flash_supported(q.shape[1], q.shape[3])

    def _splash(self, q: jax.Array) -> bool:
        """Pallas splash attention: asked for ("splash"), or "auto" on a TPU for the shapes it takes."""
        s, (t, hd) = self.settings, (q.shape[1], q.shape[3])
        if s.attention == "splash":
            # Init traces a few dummy tokens, which the kernel refuses (T a multiple of 128); the
            # parameters do not depend on the attention path.
            initializing = self.scope is not None and self.is_initializing()
            return not initializing or splash_supported(t, hd)
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


def remat_block(policy: str) -> type[Block]:
    """``Block`` under the named rematerialisation policy (needle/hardware.py's REMAT_POLICIES)."""
    if policy in ("none", "everything_saveable", "recompute"):  # recompute: apply_recomputed
        return Block
    if policy in ("everything", "nothing_saveable"):
        return nn.remat(Block)
    return nn.remat(Block, policy=lookup_checkpoint_policy(policy))
