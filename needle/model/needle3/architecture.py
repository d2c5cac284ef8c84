"""Needle 3 (cactus-needle 3.2.8's ``SimpleAttentionNetwork``) as a needle model: same parameter
tree, same logits, plus needle's call contract, KV cache, packing, LoRA and QAT.

Ported from cactus-needle 3.2.8 ``needle/model/architecture.py`` (Apache-2.0).

    from needle.model.needle3.architecture import Needle3Model
    model = Needle3Model(model_cfg)                      # model_cfg.arch == "needle3"
    logits = model.apply({"params": p}, ids)             # float32 [B, T, V], V = out_vocab or vocab_size
    logits = model.apply({"params": p}, ids, quant=True) # the reference's deploy numerics
    h = model.apply({"params": p}, ids, return_hidden=True)   # final hidden [B, T, D] (compute dtype)
    logits = model.apply({"params": p}, h, method="logits")   # == the logits above, for chunked losses

The model: token embedding x sqrt(d_model) -> (Engram n-gram memory computed once from the
tokens, read in at ``engram_layers``) -> ``num_layers`` scanned blocks on ``mhc_lanes``
hyper-connection lanes (gated GQA with q/k/v causal conv taps, zero-centred RMSNorms, RoPE,
sliding-window layers outside ``global_layers``; Hadamard MLP) -> lane mean -> final norm ->
tied output head (the first ``out_vocab`` embedding rows when set). Compute dtype is
``cfg.needle3.dtype`` (the reference's own switch; ``settings`` only decides cuDNN attention
and remat); parameters are float32 as the reference creates them.

Parameter tree (leading ``L = num_layers`` on everything under ``stack/layers``): the reference's,
name for name (``embedding/embedding``, ``stack/layers/block/self_attn/q_proj/kernel``,
``stack/mhc_phi_pre``, ``engrams_<i>/...``, ``embedding_head|confidence_head|router_head/...``).
The three probe heads are created by ``init`` (a trained Needle 3 checkpoint has them) and
carried unchanged; the LM forward does not read them. With ``lora``: ``lora_a [L, in, r]`` and
``lora_b [L, r, out]`` beside each targeted ``kernel`` (q_proj, k_proj, v_proj, gate_proj,
out_proj for LoraConfig targets q, k, v, gate, o), A ~ N(0, 1/r), B = 0, merged as
``kernel + (alpha/r)·A@B`` before use (needle.model.lora.merge_lora folds them the same way).

QAT (``qat``; default ``lora.qat`` when ``lora`` is given, else False): every kernel, embedding
table and mHC map goes through straight-through CQ at WEIGHT_BITS and ``quant`` defaults to
True, which is the reference's LoRA ``loss_fn`` (``cq_ste_params(merge_lora(...))`` with
``quant=True``). ``quant`` passed explicitly wins for activations.

Call contract (as needle.model.decoder.transformer.Transformer): ``apply(vars, tokens[B,T] int32,
positions=None, decode=False, segment_ids=None, *, quant=None, return_hidden=False)``.
``segment_ids`` packs rows: attention, the q/k/v conv and the Engram n-grams and conv never read
across a segment boundary, so with positions restarting per row a packed row's logits equal the
row's alone. The reference computes RoPE from the token index; ``positions`` generalises that.

Cached decoding follows Transformer's contract exactly (positions are cache slots; build the
cache with ``model.init(rng, zeros((B, S)), decode=True)["cache"]`` or
needle.model.decoder.transformer.init_cache). Cache collection layout: ``tokens/history [B, S]`` int32
(the token ids, which the Engram hashes read), ``engrams_<i>/value_history [B, S, D]``, and per
layer the attention caches documented in block.py.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import flax.linen as nn
import jax
import jax.nn.initializers as jinit
import jax.numpy as jnp
import numpy as np

from needle.config import LoraConfig, ModelConfig
from needle.hardware import GPU_BACKENDS, BackendSettings
from needle.model.decoder.transformer import checked_positions
from needle.model.needle3 import quantize as qz
from needle.model.needle3.block import LORA_PROJECTIONS, Needle3Module, ScanBody, head_dims
from needle.model.needle3.layers import (
    ENGRAM_CONV_TAPS, Engram, ZCRMSNorm, act_quant, default_init, history, mask_diag, res_identity_init, shift_right,
)  # fmt: skip

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
ENGRAM_SUB_DIM = 128
_ENGRAM_SEED = 0x9E3779B9
_ENGRAM_PRIME = 0x01000193
HEAD_OUT = {"embedding": None, "confidence": 1, "router": 3}  # None: embedding_dim


def engram_geometry(cfg: Any) -> tuple[tuple[int, ...], int, int]:
    """(orders, hash heads per order, table width). ``engram_heads`` 0 means "derive", not "off":
    Engram is off exactly when ``engram_layers`` is empty."""
    orders = tuple(cfg.engram_orders)
    heads = cfg.engram_heads or max(1, cfg.d_model // (len(orders) * ENGRAM_SUB_DIM))
    return orders, heads, cfg.d_model // (len(orders) * heads)


def engram_indices(shifted: list[jax.Array], orders: tuple[int, ...], heads: int, slots: int,
                   seed_heads: int = 0) -> jax.Array:  # fmt: skip
    """Hash ``shifted[j] = token[t - j]`` (0 before the start) into ``[B, T, orders·heads]`` slots."""
    stride = seed_heads or heads
    idx = []
    for oi, order in enumerate(orders):
        for h in range(heads):
            seed = (_ENGRAM_SEED * (oi * stride + h + 1)) & 0xFFFFFFFF
            acc = jnp.full_like(shifted[0], jnp.uint32(seed))
            for j in range(order):
                acc = (acc ^ shifted[j]) * jnp.uint32(_ENGRAM_PRIME)
            acc = acc ^ (acc >> jnp.uint32(15))
            idx.append((acc % jnp.uint32(slots)).astype(jnp.int32))
    return jnp.stack(idx, axis=-1)


def check_supported(cfg: Any) -> None:
    """Refuse a Needle3Config this port cannot compute exactly (ValueError naming the field)."""
    if cfg.num_heads % cfg.num_kv_heads:
        raise ValueError(f"needle3: num_heads={cfg.num_heads} is not divisible by num_kv_heads={cfg.num_kv_heads}")
    bad = [layer for layer in (*cfg.engram_layers, *cfg.global_layers) if not 0 <= layer < cfg.num_layers]
    if bad:
        raise ValueError(f"needle3: engram_layers/global_layers name layers {bad} outside 0..{cfg.num_layers - 1}")
    if cfg.engram_layers and (not cfg.engram_orders or min(cfg.engram_orders) < 1 or not cfg.engram_slots):
        raise ValueError("needle3: Engram needs engram_orders >= 1 and engram_slots > 0")
    qk_hd, _ = head_dims(cfg)
    if qk_hd % 2:
        raise ValueError(f"needle3: qk_head_dim={qk_hd} must be even for RoPE")


class _Table(nn.Module):
    """The ``embedding`` parameter of the token embedding (also the tied output head)."""

    num: int
    features: int
    qat: bool = False

    @nn.compact
    def __call__(self) -> jax.Array:
        table = self.param("embedding", jinit.normal(stddev=0.02), (self.num, self.features))
        return qz.cq_ste(table, qz.WEIGHT_BITS) if self.qat else table


class _TokenHistory(nn.Module):
    """Decoding: the token ids by cache slot (Engram hashes read the previous ones)."""

    @nn.compact
    def __call__(self, tokens: jax.Array, positions: jax.Array) -> jax.Array:
        var = self.variable("cache", "history", jnp.zeros, tokens.shape, jnp.int32)
        rows = jnp.arange(tokens.shape[0])[:, None]
        var.value = var.value.at[rows, positions].set(tokens.astype(jnp.int32))
        return var.value


class _HeadProj(nn.Module):
    features: int
    use_bias: bool = True

    @nn.compact
    def __call__(self, d_in: int) -> None:
        self.param("kernel", default_init(), (d_in, self.features))
        if self.use_bias:
            self.param("bias", jinit.zeros, (self.features,))


class ProbeHead(nn.Module):
    """Parameters of a reference probe head (embedding, confidence, router), names and inits as
    there; needle carries them through loading, training (frozen under LoRA) and saving."""

    cfg: Any
    kind: str

    @nn.compact
    def __call__(self) -> None:
        cfg, l1, d = self.cfg, self.cfg.num_layers + 1, self.cfg.d_model
        k, q = getattr(cfg, f"{self.kind}_probes"), getattr(cfg, f"{self.kind}_queries")
        self.param("probes", default_init(), (l1, k, d))
        self.param("gain", jinit.ones, (l1, k))
        self.param("query", default_init(), (q, d))
        self.param("row_bias", jinit.zeros, (q, l1, k))
        out = HEAD_OUT[self.kind] or cfg.embedding_dim
        _HeadProj(out, use_bias=self.kind != "embedding", name="proj")(q * d)
        if self.kind == "embedding":
            self.param("log_temp", jinit.constant(math.log(10.0)), ())
            self.param("bias", jinit.constant(-10.0), ())


class Stack(Needle3Module):
    """mHC lanes around the scanned layers, then lane mean and the final norm."""

    fused: bool = False
    remat: bool = False

    @nn.compact
    def __call__(self, x: jax.Array, mask: jax.Array, local_mask: Any, rope: Any, engram_kv: Any,
                 positions: Any, quant: bool = False, decode: bool = False) -> jax.Array:  # fmt: skip
        cfg, dt = self.cfg, self.dtype
        x = x.astype(dt)
        site_flags = None
        if engram_kv is not None:
            flags = np.zeros((cfg.num_layers, len(cfg.engram_layers)), np.float32)
            for s, layer in enumerate(cfg.engram_layers):
                flags[layer, s] = 1.0
            site_flags = jnp.asarray(flags)
        gflags = jnp.asarray([1.0 if i in cfg.global_layers else 0.0 for i in range(cfg.num_layers)])
        n, L, nc = cfg.mhc_lanes, cfg.num_layers, cfg.mhc_lanes * cfg.d_model
        lane = np.eye(n, dtype=np.float32)[np.arange(L) % n]

        def phi(name: str, shape: tuple) -> jax.Array:
            w = self.param(name, default_init(), shape)
            return jnp.swapaxes(qz.cq_ste(jnp.swapaxes(w, -1, -2), qz.WEIGHT_BITS), -1, -2) if self.qat else w

        hc = {
            "phi_pre": phi("mhc_phi_pre", (L, nc, n)),
            "phi_post": phi("mhc_phi_post", (L, nc, n)),
            "phi_res": phi("mhc_phi_res", (L, nc, n * n)),
            "b_pre": self.param("mhc_b_pre", jinit.zeros, (L, n)),
            "b_post": self.param("mhc_b_post", jinit.zeros, (L, n)),
            "b_res": self.param("mhc_b_res", res_identity_init, (L, n, n)),
            "a_pre": self.param("mhc_a_pre", jinit.constant(0.01), (L,)),
            "a_post": self.param("mhc_a_post", jinit.constant(0.01), (L,)),
            "a_res": self.param("mhc_a_res", jinit.constant(0.01), (L,)),
            "pre_off": jnp.asarray(8 * lane - 4),
            "post_off": jnp.asarray(-4 * (1 - lane)),
        }
        x = jnp.broadcast_to(x[:, :, None, :], (*x.shape[:2], n, x.shape[-1]))
        body = nn.remat(ScanBody) if self.remat and not decode else ScanBody
        scan = nn.scan(
            body, variable_axes={"params": 0, "cache": 0}, split_rngs={"params": True}, length=L,
            unroll=cfg.scan_unroll, in_axes=(0, nn.broadcast, nn.broadcast, nn.broadcast, nn.broadcast, nn.broadcast),
        )  # fmt: skip
        layers = scan(cfg, dt, self.lora, self.qat, quant, decode, self.fused, name="layers")
        x, _ = layers(x, (site_flags, gflags, hc), mask, local_mask, rope, engram_kv, positions)
        return ZCRMSNorm(dtype=dt, name="final_norm")(jnp.mean(x, axis=2))


class Needle3Model(nn.Module):
    """Needle 3's decoder; see the module docstring for the call contract, cache and LoRA layout."""

    cfg: ModelConfig
    lora: LoraConfig | None = None
    settings: BackendSettings | None = None
    qat: bool | None = None  # None: lora.qat when lora is given, else False
    # The top-level params ``logits`` reads (the tied head; the chunked loss differentiates only these).
    head_names: ClassVar[tuple[str, ...]] = ("embedding",)

    def setup(self) -> None:
        cfg = self.cfg.needle3
        if cfg is None:
            raise ValueError(f"Needle3Model needs ModelConfig.arch='needle3' with a needle3 config, got arch={self.cfg.arch!r}")
        check_supported(cfg)
        if self.lora is not None and not any(t in LORA_PROJECTIONS for t in self.lora.targets):
            raise ValueError(
                f"needle3: LoraConfig.targets={self.lora.targets} selects no Needle 3 projection "
                f"(it has {', '.join(f'{k}={v}' for k, v in LORA_PROJECTIONS.items())}; up/down do not exist)"
            )
        self.n3 = cfg
        self.dt = DTYPES[cfg.dtype]
        qat = self.use_qat
        self.embedding = _Table(cfg.vocab_size, cfg.d_model, qat)
        self.token_history = _TokenHistory(name="tokens")
        orders, heads, sub_dim = engram_geometry(cfg)
        self.engrams = [
            Engram(cfg.d_model, len(orders) * heads, cfg.engram_slots, sub_dim, cfg.num_layers, max(orders), self.dt,
                   cfg.act_bits, qat)  # fmt: skip
            for _ in cfg.engram_layers
        ]
        self.embedding_head = ProbeHead(cfg, "embedding")
        self.confidence_head = ProbeHead(cfg, "confidence")
        self.router_head = ProbeHead(cfg, "router")
        self.stack = Stack(cfg, self.dt, self.lora, qat, self._fused(), self._remat())

    @property
    def use_qat(self) -> bool:
        if self.qat is not None:
            return bool(self.qat)
        return bool(self.lora is not None and getattr(self.lora, "qat", False))

    def _fused(self) -> bool:
        s = self.settings
        return bool(s is not None and s.fused_attention and s.backend in GPU_BACKENDS and jax.default_backend() in GPU_BACKENDS)

    def _remat(self) -> bool:
        return bool(self.settings.rematerialises) if self.settings is not None else bool(self.cfg.needle3.remat)

    def __call__(self, tokens: jax.Array, positions: jax.Array | None = None, decode: bool = False,
                 segment_ids: jax.Array | None = None, *, quant: bool | None = None,
                 return_hidden: bool = False) -> jax.Array:  # fmt: skip
        cfg = self.n3
        quant = self.use_qat if quant is None else bool(quant)
        positions = checked_positions(tokens, positions, segment_ids, decode)
        t = tokens.shape[1]
        if self.is_initializing():  # a trained checkpoint has the probe heads: create them
            self.embedding_head()
            self.confidence_head()
            self.router_head()

        sw = cfg.sliding_window
        if decode:
            hist = self.token_history(tokens, positions)
            slots = jnp.arange(hist.shape[1])
            rel = positions[:, None, :, None] - slots[None, None, None, :]  # [B, 1, T, S]
            mask = rel >= 0
            local_mask = (mask & (rel < sw)) if sw else None
        else:
            hist = None
            idx = jnp.arange(t)
            mask = jnp.tril(jnp.ones((t, t), jnp.bool_))[None, None]
            if segment_ids is not None:
                mask = mask & (segment_ids[:, None, :, None] == segment_ids[:, None, None, :])
            local_mask = (mask & ((idx[:, None] - idx[None, :]) < sw)[None, None]) if sw else None

        x = jnp.take(self.embedding(), tokens, axis=0) * math.sqrt(cfg.d_model)
        qk_hd, _ = head_dims(cfg)
        freqs = 1.0 / (cfg.rope_theta ** (jnp.arange(0, qk_hd, 2).astype(jnp.float32) / qk_hd))
        angles = positions.astype(jnp.float32)[:, None, :, None] * freqs  # [B, 1, T, hd/2]
        rope = (jnp.cos(angles), jnp.sin(angles))
        engram_kv = self._engram_kv(tokens, mask, positions, hist, quant, decode)
        x = self.stack(x, mask, local_mask, rope, engram_kv, positions if decode else None, quant=quant, decode=decode)
        if return_hidden:
            return x
        return self.logits(x, quant=quant)

    def logits(self, hidden: jax.Array, quant: bool | None = None) -> jax.Array:
        """Final hidden states ``[..., D]`` -> float32 logits ``[..., V]`` (the tied head)."""
        quant = self.use_qat if quant is None else bool(quant)
        head = self.embedding()
        if self.n3.out_vocab:
            head = head[: self.n3.out_vocab]
        return act_quant(hidden, quant, self.n3.act_bits).astype(jnp.float32) @ head.T

    def _engram_kv(self, tokens: jax.Array, mask: jax.Array, positions: jax.Array, hist: Any, quant: bool,
                   decode: bool) -> Any:  # fmt: skip
        cfg = self.n3
        if not cfg.engram_layers:
            return None
        orders, heads, _ = engram_geometry(cfg)
        dil = max(orders)
        if decode:
            shifted = []
            for j in range(dil):
                tok, ok = history(hist, positions, j)
                shifted.append(jnp.where(ok, tok, 0).astype(jnp.uint32))
            ngram_ok = jnp.stack([positions >= o - 1 for o in orders for _ in range(heads)], axis=-1)
            tap_ok = jnp.stack([positions >= j * dil for j in range(ENGRAM_CONV_TAPS)])
        else:
            u = tokens.astype(jnp.uint32)
            shifted = [shift_right(u, j) for j in range(dil)]
            ngram_ok = jnp.stack([mask_diag(mask, o - 1) for o in orders for _ in range(heads)], axis=-1)
            tap_ok = jnp.stack([mask_diag(mask, j * dil) for j in range(ENGRAM_CONV_TAPS)])
        indices = engram_indices(shifted, orders, heads, cfg.engram_slots, cfg.engram_seed_heads)
        pairs = [e(indices, ngram_ok, tap_ok, quant, positions, decode) for e in self.engrams]
        return jnp.stack([k for k, _ in pairs]), jnp.stack([v for _, v in pairs])
