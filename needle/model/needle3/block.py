"""Needle 3's attention, block and scanned layer body (mHC lanes), with needle's KV cache.

Ported from cactus-needle 3.2.8 ``needle/model/architecture.py`` (Apache-2.0): the arithmetic
of ``MultiHeadAttention``, ``Block`` and ``_ScanBody`` is the reference's, line for line; the
ladder/early-exit paths (``exit_depth``, ``subnetwork_only``), which the LM forward never takes,
are left out.

Decoding (``decode=True``) keeps per layer, in the ``"cache"`` collection under
``stack/layers/block/self_attn``: ``cached_key [L, B, S, kv_heads, qk_head_dim]`` and
``cached_value [L, B, S, kv_heads, v_head_dim]`` (after conv, norm, RoPE and, under ``quant``,
KV quantisation: what attention reads), and with ``qkv_conv_taps`` the pre-conv projections
``q_history``/``k_history``/``v_history [L, B, S, features]`` the causal conv reads at
``position - j``. ``S`` is the cache length; positions are slots (see architecture.py).
"""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.nn.initializers as jinit
import jax.numpy as jnp

from needle.model.needle3 import quantize as qz
from needle.model.needle3.layers import (
    Dense, HadamardMLP, ZCRMSNorm, act_quant, apply_rope, conv_identity_init, default_init, history,
    mask_diag, residual_init, rms_unit, shift_right, sinkhorn, write_slots,
)  # fmt: skip

# LoraConfig.targets (needle's short names) -> Needle 3's projections. The reference's
# LORA_TARGETS are q_proj, k_proj, v_proj, gate_proj (the attention's output gate) and out_proj;
# needle's "up"/"down" have no Needle 3 counterpart (the MLP is a Hadamard transform).
LORA_PROJECTIONS = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "gate": "gate_proj", "o": "out_proj"}


def head_dims(cfg: Any) -> tuple[int, int]:
    legacy = cfg.d_model // cfg.num_heads
    return cfg.qk_head_dim or legacy, cfg.v_head_dim or legacy


class Needle3Module(nn.Module):
    """The settings every module of Needle 3's layer stack carries, in its constructors' positional order."""

    cfg: Any  # Needle3Config
    dtype: Any
    lora: Any = None  # LoraConfig | None
    qat: bool = False


class LayerModule(Needle3Module):
    """A layer's modules also carry the call's numerics (``quant``), cache use (``decode``) and ``fused``."""

    quant: bool = False
    decode: bool = False
    fused: bool = False  # cuDNN attention allowed (GPU, half precision)


class MultiHeadAttention(LayerModule):
    """Gated GQA with q/k/v causal conv taps, zero-centred q/k norms and RoPE."""

    def dense(self, name: str, features: int, init: Any) -> Dense:
        lora = self.lora
        wants = lora is not None and name in {LORA_PROJECTIONS[t] for t in lora.targets if t in LORA_PROJECTIONS}
        return Dense(features, self.dtype, init, lora.rank if wants else 0, lora.scale if wants else 1.0,
                     self.qat, name=name)  # fmt: skip

    @nn.compact
    def __call__(self, x: jax.Array, mask: jax.Array, rope: tuple[jax.Array, jax.Array], positions: jax.Array | None,
                 tap_ok: list) -> jax.Array:  # fmt: skip
        cfg, dt = self.cfg, self.dtype
        nh, nkv = cfg.num_heads, cfg.num_kv_heads
        qk_hd, v_hd = head_dims(cfg)
        out_dim = nh * v_hd
        b = x.shape[0]

        x = act_quant(x, self.quant, cfg.act_bits)
        q = self.dense("q_proj", nh * qk_hd, default_init())(x)
        k = self.dense("k_proj", nkv * qk_hd, default_init())(x)
        v = self.dense("v_proj", nkv * v_hd, default_init())(x)

        if cfg.qkv_conv_taps:
            n_taps = cfg.qkv_conv_taps
            qt = self.param("q_taps", conv_identity_init, (n_taps, nh * qk_hd)).astype(dt)
            kt = self.param("k_taps", conv_identity_init, (n_taps, nkv * qk_hd)).astype(dt)
            vt = self.param("v_taps", conv_identity_init, (n_taps, nkv * v_hd)).astype(dt)
            ok = [None] + [tap_ok[j].astype(q.dtype) for j in range(1, n_taps)]

            def conv(name: str, z: jax.Array, taps: jax.Array) -> jax.Array:
                if self.decode:
                    var = self.variable("cache", f"{name}_history", jnp.zeros, z.shape, z.dtype)
                    hist = write_slots(var, z, positions)
                    shifted = [z] + [history(hist, positions, j)[0] for j in range(1, n_taps)]
                else:
                    shifted = [z] + [shift_right(z, j) for j in range(1, n_taps)]
                return sum(taps[j] * (shifted[j] if ok[j] is None else shifted[j] * ok[j]) for j in range(n_taps))

            q, k, v = conv("q", q, qt), conv("k", k, kt), conv("v", v, vt)

        q = q.reshape(b, -1, nh, qk_hd).transpose(0, 2, 1, 3)
        k = k.reshape(b, -1, nkv, qk_hd).transpose(0, 2, 1, 3)
        v = v.reshape(b, -1, nkv, v_hd).transpose(0, 2, 1, 3)
        q = ZCRMSNorm(dtype=dt, name="q_norm")(q)
        k = ZCRMSNorm(dtype=dt, name="k_norm")(k)
        cos, sin = rope
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.quant:
            q = qz.quant_query(q, cfg.act_bits)
            k = qz.quant_kv(k, cfg.kv_bits)
            v = qz.quant_kv(v, cfg.kv_bits)

        if self.decode:  # attend to the whole cache; the mask says which slots
            ck = self.variable("cache", "cached_key", jnp.zeros, (b, k.shape[2], nkv, qk_hd), k.dtype)
            cv = self.variable("cache", "cached_value", jnp.zeros, (b, v.shape[2], nkv, v_hd), v.dtype)
            k = write_slots(ck, k.transpose(0, 2, 1, 3), positions).transpose(0, 2, 1, 3)
            v = write_slots(cv, v.transpose(0, 2, 1, 3), positions).transpose(0, 2, 1, 3)

        if cfg.flash:
            fused_hd = max(qk_hd, v_hd)
            qf = q * jnp.asarray(math.sqrt(fused_hd / qk_hd), q.dtype)
            pad_qk = fused_hd - qk_hd
            if pad_qk:
                qf = jnp.pad(qf, ((0, 0), (0, 0), (0, 0), (0, pad_qk)))
                k = jnp.pad(k, ((0, 0), (0, 0), (0, 0), (0, pad_qk)))
            pad_v = fused_hd - v_hd
            vf = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, pad_v))) if pad_v else v
            impl = "cudnn" if self.fused and not self.decode and q.dtype in (jnp.bfloat16, jnp.float16) else None
            out = jax.nn.dot_product_attention(
                qf.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), vf.transpose(0, 2, 1, 3), mask=mask,
                implementation=impl,
            )  # fmt: skip
            out = out[..., :v_hd].reshape(b, -1, out_dim)
        else:
            repeats = nh // nkv
            if repeats > 1:
                k = jnp.repeat(k, repeats, axis=1)
                v = jnp.repeat(v, repeats, axis=1)
            scale = jnp.sqrt(jnp.float32(qk_hd))
            w = jnp.matmul(q, k.transpose(0, 1, 3, 2)) / scale
            w = jnp.where(mask, w, jnp.finfo(w.dtype).min)
            w = nn.softmax(w, axis=-1)
            out = jnp.matmul(w, v).transpose(0, 2, 1, 3).reshape(b, -1, out_dim)

        out = out * nn.sigmoid(self.dense("gate_proj", out_dim, default_init())(x))
        out = act_quant(out, self.quant, cfg.act_bits)
        return self.dense("out_proj", cfg.d_model, residual_init(cfg.num_layers))(out)


class Block(LayerModule):
    """Engram read-in, gated attention with post-norm, then the Hadamard MLP (both residual)."""

    @nn.compact
    def __call__(self, x: jax.Array, mask: jax.Array, rope: Any, positions: Any, tap_ok: list, engram_kv: Any,
                 site_flags: Any) -> jax.Array:  # fmt: skip
        cfg, dt = self.cfg, self.dtype
        if engram_kv is not None:
            ek, ev = engram_kv
            alpha = nn.sigmoid(jnp.einsum("btd,sbtd->sbt", rms_unit(x), rms_unit(ek)) / math.sqrt(cfg.d_model))
            x = x + jnp.einsum("s,sbt,sbtd->btd", site_flags.astype(jnp.float32), alpha,
                               ev.astype(jnp.float32)).astype(x.dtype)  # fmt: skip
        skip = x
        x = ZCRMSNorm(dtype=dt, name="ZCRMSNorm_0")(x)
        x = MultiHeadAttention(cfg, dt, self.lora, self.qat, self.quant, self.decode, self.fused, name="self_attn")(
            x, mask, rope, positions, tap_ok
        )
        x = ZCRMSNorm(dtype=dt, name="post_attn_norm")(x)
        x = skip + nn.sigmoid(self.param("attn_gate", jinit.zeros, ())).astype(dt) * x
        skip = x
        x = ZCRMSNorm(dtype=dt, name="pre_hada_norm")(x)
        x = HadamardMLP(cfg.d_model, dt, split_perms=bool(cfg.ladder_widths), name="hadamard_mlp")(x)
        return skip + x


class ScanBody(LayerModule):
    """One layer under ``nn.scan``: picks the layer's mask (global or sliding), then the mHC update
    ``lanes <- H_res·lanes + H_post ⊗ (block(H_pre·lanes) - H_pre·lanes)`` of the reference."""

    @nn.compact
    def __call__(self, carry: jax.Array, xs: Any, mask: jax.Array, local_mask: Any, rope: Any, engram_kv: Any,
                 positions: Any) -> tuple[jax.Array, None]:  # fmt: skip
        cfg, dt = self.cfg, self.dtype
        site_flags, gflag, hc = xs
        if local_mask is not None:
            mask = jnp.where(gflag > 0, mask, local_mask)
        if self.decode:  # tap j of token p reads slot p - j (a sliding layer only within its window)
            tap_ok = [None]
            for j in range(1, max(cfg.qkv_conv_taps, 1)):
                ok = positions >= j
                if local_mask is not None and j >= cfg.sliding_window:
                    ok = ok & (gflag > 0)
                tap_ok.append(ok[..., None])
        else:
            tap_ok = [None] + [mask_diag(mask, j)[..., None] for j in range(1, max(cfg.qkv_conv_taps, 1))]
        block = Block(cfg, dt, self.lora, self.qat, self.quant, self.decode, self.fused, name="block")

        b, t, n, c = carry.shape
        xf = carry.astype(jnp.float32)
        nx = act_quant(rms_unit(carry.reshape(b, t, n * c)), self.quant, cfg.act_bits)
        hpre = nn.sigmoid(hc["a_pre"] * (nx @ hc["phi_pre"].astype(jnp.float32)) + hc["b_pre"] + hc["pre_off"])
        u = jnp.einsum("btn,btnc->btc", hpre, xf).astype(dt)
        y = block(u, mask, rope, positions, tap_ok, engram_kv, site_flags) - u
        hpost = 2 * nn.sigmoid(hc["a_post"] * (nx @ hc["phi_post"].astype(jnp.float32)) + hc["b_post"] + hc["post_off"])
        res = nx @ hc["phi_res"].astype(jnp.float32)
        hres = sinkhorn(hc["a_res"] * res.reshape(b, t, n, n) + hc["b_res"])
        new = jnp.einsum("btij,btjc->btic", hres, xf) + hpost[..., None] * y.astype(jnp.float32)[:, :, None, :]
        return new.astype(dt), None
