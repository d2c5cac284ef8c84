"""GGUF metadata <-> needle's ``ModelConfig``, through a Hugging Face ``config.json`` dict.

Import maps ``{arch}.*`` hyper-parameters (llama.cpp's keys) onto the ``config.json`` keys the
same family's Hugging Face checkpoint has and hands that dict to
:func:`needle.model.hf.config.hf_config_to_model_config`, so a GGUF model gets exactly the switches an
HF import of the same model gets (and keeps the dict in ``hf_config``, so ``needle export
--format hf`` of a GGUF import works too). Export writes the keys back from a ``ModelConfig``.

    hf = gguf_to_hf_config(read_gguf("m.gguf"))     # {"model_type": "llama", "hidden_size": 576, ...}
    meta = gguf_metadata(cfg)                       # {"llama.block_count": 30, ...} for GGUFWriter

Families: ``llama`` (also needle's own architecture, which is exactly a Llama), ``qwen2``,
``qwen3``, ``gemma3`` (its layer pattern and local RoPE base as llama.cpp's
``attention.sliding_window_pattern`` and ``rope.freq_base_swa``; without them every 6th layer is
global and the local base 10,000, llama.cpp's defaults).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from needle.config import ModelConfig
from needle.errors import ModelImportError
from needle.model.gguf.reader import GGUFFile
from needle.model.hf.config import hf_config_to_model_config
from needle.model.hf.export import model_config_to_hf_config
from needle.model.decoder.block import rope_inv_freq

# general.architecture -> Hugging Face model_type, and back.
GGUF_ARCHS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3_text"}
HF_TO_GGUF = {"llama": "llama", "needle": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3_text": "gemma3"}
# llama.cpp's Gemma 3 defaults (src/models/gemma3.cpp) when the file does not say: every 6th layer global, local RoPE 10,000.
GEMMA3_PATTERN, GEMMA3_LOCAL_THETA = 6, 10000.0


def _one(value: Any, key: str, f: GGUFFile) -> int:
    # Some converters write per-layer arrays (head_count_kv); needle's layers are uniform.
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise f.fail(f"{key} differs between layers ({sorted(set(value))}); needle's layers are uniform")
        value = value[0]
    return int(value)


def _f32(value: Any) -> float:
    """A float32 metadata value as the decimal it was written from (1e-06, not 9.99999997e-07)."""
    return float(str(np.float32(value)))


def _gemma3_layers(f: GGUFFile, key: Any, n_layers: int) -> dict[str, Any]:
    """Layer kinds as llama.cpp reads them: no sliding window, all global; else the pattern key (a
    per-layer bool array, or every Nth layer global), default 6."""
    window = int(key("attention.sliding_window", 0))
    if window <= 0:
        return {"layer_types": ["full_attention"] * n_layers}
    pattern = key("attention.sliding_window_pattern", GEMMA3_PATTERN)
    if isinstance(pattern, list):
        if len(pattern) < n_layers:
            raise f.fail(f"gemma3.attention.sliding_window_pattern has {len(pattern)} entries for {n_layers} layers")
        sliding = [bool(x) for x in pattern[:n_layers]]
    else:
        sliding = [(i + 1) % int(pattern) != 0 for i in range(n_layers)]
    kinds = ["sliding_attention" if s else "full_attention" for s in sliding]
    return {"layer_types": kinds, "sliding_window": window}


def gguf_to_hf_config(f: GGUFFile) -> dict[str, Any]:
    """The Hugging Face ``config.json`` dict equivalent to ``f``'s metadata (an error names what is missing)."""
    m = f.metadata
    arch = m.get("general.architecture")
    if arch not in GGUF_ARCHS:
        raise f.fail(f"general.architecture {arch!r} is not supported; needle reads {', '.join(GGUF_ARCHS)}")

    def key(name: str, default: Any = KeyError) -> Any:
        full = f"{arch}.{name}"
        if full in m:
            return m[full]
        if default is KeyError:
            raise f.fail(f"metadata key {full} is missing (needed for {arch})")
        return default

    heads = _one(key("attention.head_count"), f"{arch}.attention.head_count", f)
    d_model = int(key("embedding_length"))
    head_dim = int(key("attention.key_length", key("rope.dimension_count", d_model // heads)))
    vocab = key("vocab_size", None) or len(m.get("tokenizer.ggml.tokens") or []) or None
    if vocab is None and "token_embd.weight" in f.tensors:
        vocab = f.tensors["token_embd.weight"].dims[-1]
    hf: dict[str, Any] = {
        "model_type": GGUF_ARCHS[arch], "vocab_size": int(vocab or 0), "hidden_size": d_model,
        "intermediate_size": _one(key("feed_forward_length"), f"{arch}.feed_forward_length", f),
        "num_hidden_layers": int(key("block_count")), "num_attention_heads": heads,
        "num_key_value_heads": _one(key("attention.head_count_kv", heads), f"{arch}.attention.head_count_kv", f),
        "head_dim": head_dim, "max_position_embeddings": int(key("context_length")),
        "rms_norm_eps": _f32(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": _f32(key("rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in f.tensors,
        "attention_bias": "blk.0.attn_q.bias" in f.tensors and arch != "qwen2",
    }  # fmt: skip
    scaling = key("rope.scaling.type", "none")
    if scaling == "linear":
        hf["rope_scaling"] = {"rope_type": "linear", "factor": _f32(key("rope.scaling.factor"))}
    elif scaling != "none":
        raise f.fail(f"{arch}.rope.scaling.type {scaling!r} is not supported (none, linear)")
    if "rope_freqs.weight" in f.tensors:
        hf["rope_scaling"] = _llama3_from_factors(f, hf, int(key("rope.scaling.original_context_length", 8192)))
    if arch == "gemma3":
        hf.update(hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=head_dim,
                  rope_local_base_freq=_f32(key("rope.freq_base_swa", GEMMA3_LOCAL_THETA)),
                  final_logit_softcapping=_f32(soft) if (soft := key("final_logit_softcapping", None)) else None,
                  **_gemma3_layers(f, key, hf["num_hidden_layers"]))  # fmt: skip
    else:
        hf["hidden_act"] = "silu"
    return hf


def llama3_factors(cfg: ModelConfig) -> np.ndarray | None:
    """llama.cpp's ``rope_freqs.weight`` of a ``llama3``-scaled config: each frequency's divisor."""
    if cfg.rope_scaling is None or cfg.rope_scaling.type != "llama3":
        return None
    plain = rope_inv_freq(cfg.model_copy(update={"rope_scaling": None, "arch": "llama"}))
    return (plain / rope_inv_freq(cfg)).astype(np.float32)


def _llama3_from_factors(f: GGUFFile, hf: dict[str, Any], original: int) -> dict[str, Any]:
    """The ``llama3`` scaling whose divisors are the file's ``rope_freqs.weight`` (Llama 3.x's converter
    writes them instead of the parameters): the largest divisor is the factor; low/high 1 and 4 and the
    original context as every Llama 3.x has them, checked against the tensor."""
    factors = f.tensor("rope_freqs.weight")
    scaling = {"rope_type": "llama3", "factor": round(float(factors.max()), 4), "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": original}  # fmt: skip
    want = llama3_factors(hf_config_to_model_config({**hf, "rope_scaling": scaling}))
    if want is None or want.shape != factors.shape or not np.allclose(want, factors, rtol=1e-4):
        raise f.fail("rope_freqs.weight is not Llama 3.x's llama3 RoPE scaling (factor, 1, 4, "
                     f"{original}); other frequency divisors are not supported")  # fmt: skip
    return scaling


def _gemma3_metadata(cfg: ModelConfig) -> dict[str, Any]:
    """Gemma 3's layer pattern and local RoPE base; refuses an attention scale llama.cpp cannot take."""
    if cfg.query_pre_attn_scalar not in (None, cfg.head_dim):  # llama.cpp scales by head_dim ** -0.5
        raise ModelImportError(f"Gemma 3 with query_pre_attn_scalar {cfg.query_pre_attn_scalar} != head_dim "
                               f"{cfg.head_dim} cannot be written for llama.cpp")  # fmt: skip
    kinds = cfg.resolved_layer_types()
    if "sliding_attention" not in kinds:
        return {}
    return {"attention.sliding_window": cfg.sliding_window, "rope.freq_base_swa": float(cfg.rope_local_theta or cfg.rope_theta),
            "attention.sliding_window_pattern": [k == "sliding_attention" for k in kinds]}  # fmt: skip


def gguf_metadata(cfg: ModelConfig) -> tuple[str, dict[str, Any]]:
    """``(general.architecture, {key: value})`` of the hyper-parameters llama.cpp reads for ``cfg``."""
    if cfg.arch not in HF_TO_GGUF:
        raise ModelImportError(f"a {cfg.arch} model cannot be written as GGUF; needle writes {', '.join(HF_TO_GGUF)}")
    if cfg.arch == "needle":  # needle's own architecture must be exactly a Llama (same check as the HF export)

        model_config_to_hf_config(cfg)
    arch = HF_TO_GGUF[cfg.arch]
    original = json.loads(cfg.hf_config) if cfg.hf_config else {}
    meta: dict[str, Any] = {
        "context_length": int(original.get("max_position_embeddings") or cfg.max_len),
        "embedding_length": cfg.d_model, "block_count": cfg.n_layers, "feed_forward_length": cfg.d_ff,
        "attention.head_count": cfg.n_heads, "attention.head_count_kv": cfg.n_kv_heads,
        "attention.key_length": cfg.head_dim, "attention.value_length": cfg.head_dim,
        "rope.dimension_count": cfg.head_dim, "rope.freq_base": float(cfg.rope_theta),
        "attention.layer_norm_rms_epsilon": float(cfg.norm_eps), "vocab_size": cfg.vocab_size,
    }  # fmt: skip
    if cfg.rope_scaling is not None and cfg.rope_scaling.type == "linear":
        meta.update({"rope.scaling.type": "linear", "rope.scaling.factor": float(cfg.rope_scaling.factor)})
    elif cfg.rope_scaling is not None:  # llama3: the divisors travel as the rope_freqs.weight tensor
        meta["rope.scaling.original_context_length"] = cfg.rope_scaling.original_max_len
    if arch == "gemma3":
        meta.update(_gemma3_metadata(cfg))
    if cfg.final_softcap:
        meta["final_logit_softcapping"] = float(cfg.final_softcap)
    return arch, {f"{arch}.{k}": v for k, v in meta.items()}
