"""Hugging Face checkpoints: where a model comes from, and its config.json as a ``ModelConfig``.

Supported ``model_type``s: ``llama`` (Llama 3.x with ``llama3`` RoPE scaling, SmolLM2), ``qwen2``
(q/k/v biases), ``qwen3`` (q/k norms, explicit head_dim) and ``gemma3_text`` (Gemma 3 and
FunctionGemma: scaled embeddings, ``(1 + w)`` norms, pre- and post-norms, GELU-tanh MLP,
sliding-window and global layers with their own RoPE bases). Both config layouts are read:
transformers 5 (``rope_parameters``, per layer type for Gemma 3) and 4 (``rope_theta`` +
``rope_scaling``, Gemma's ``rope_local_base_freq`` and ``sliding_window_pattern``).

    src = resolve_model_source("hf:Qwen/Qwen3-0.6B@main")     # or a local directory
    cfg = hf_config_to_model_config(src.path / "config.json", max_len=2048)
    params = load_hf_params(src.path, cfg)                    # needle/model/hf/weights.py

Weights: needle/model/hf/weights.py. Export back to HF / PEFT: needle/model/hf/export.py.
"""

from __future__ import annotations

import json
import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from needle.config import ModelConfig, RopeScaling, imported_max_len
from needle.errors import ModelImportError

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "gemma3_text")
HF_CLASSES = {
    "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
}  # fmt: skip
# What snapshot_download fetches: config, weights, tokenizer and chat template, nothing else.
ALLOW_PATTERNS = [
    "config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
    "chat_template.json",
]  # fmt: skip
_HUB_SPEC = re.compile(r"^hf:(?P<repo>[\w.\-]+(?:/[\w.\-]+)?)(?:@(?P<rev>[\w.\-/]+))?$")
_ACTS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


@dataclass(frozen=True)
class ModelSource:
    """A resolved model: its local directory, what the user named, and the hub revision/commit."""

    path: Path
    source: str
    revision: str | None = None
    commit: str | None = None

    def as_meta(self) -> dict[str, Any]:
        return {"source": self.source, "revision": self.revision, "commit": self.commit}


def _read_config(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None


def is_hf_model_dir(path: str | Path) -> bool:
    """True when ``path`` holds a Hugging Face ``config.json`` (one with a ``model_type``)."""
    p = Path(path)
    cfg = _read_config(p) if p.is_dir() else None
    return isinstance(cfg, dict) and "model_type" in cfg


def _offline() -> bool:
    # Read at call time: huggingface_hub.constants freezes the variable at its import.
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _hub_reachable(timeout: float = 3.0) -> bool:
    """One TCP connect to the hub endpoint: a machine without network fails here in seconds."""
    from huggingface_hub import constants

    url = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname or "", url.port or 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def _download(repo: str, revision: str | None, allow_patterns: list[str] | None = None) -> Path:
    from huggingface_hub import snapshot_download

    local_only = _offline() or not _hub_reachable()
    patterns = allow_patterns or ALLOW_PATTERNS
    try:
        return Path(
            snapshot_download(repo, revision=revision, allow_patterns=patterns, local_files_only=local_only, etag_timeout=5)
        )
    except Exception as e:  # noqa: BLE001 - every hub failure becomes one clear message
        why = "HF_HUB_OFFLINE is set" if _offline() else "the hub is unreachable" if local_only else "download failed"
        if local_only:
            raise ModelImportError(
                f"hf:{repo}{'@' + revision if revision else ''}: not in the local Hugging Face cache and {why}; "
                "download it on a machine with network (or pass a local model directory)"
            ) from e
        raise ModelImportError(f"hf:{repo}: {why}: {type(e).__name__}: {e}") from e


def download_snapshot(spec: str, allow_patterns: list[str] | None = None) -> ModelSource:
    """``hf:owner/name[@revision]`` fetched through the hub cache (offline: the cache, or one clear error)."""
    m = _HUB_SPEC.match(spec)
    if not m:
        raise ModelImportError(f"{spec!r}: expected hf:owner/name or hf:owner/name@revision")
    path = _download(m["repo"], m["rev"], allow_patterns)
    return ModelSource(path, m["repo"], m["rev"] or "main", path.name)


def resolve_model_source(spec: str | Path) -> ModelSource:
    """A local model directory, or ``hf:owner/name[@revision]`` fetched through the hub cache."""
    text = str(spec)
    if text.startswith("hf:"):
        return download_snapshot(text)
    path = Path(text).expanduser().absolute()
    if not path.is_dir():
        raise ModelImportError(f"{path}: no such model directory (or use hf:owner/name for a hub model)")
    return ModelSource(path, str(path))


def _rope(params: dict[str, Any], where: str) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) of one RoPE parameter dict (transformers 4 or 5 spelling)."""
    kind = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", 10000.0))
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ModelImportError(f"{where}: partial_rotary_factor is not supported")
    if kind == "default":
        return theta, None
    if kind == "linear":
        return theta, RopeScaling(type="linear", factor=params["factor"])
    if kind == "llama3":
        return theta, RopeScaling(
            type="llama3", factor=params["factor"], low_freq_factor=params["low_freq_factor"],
            high_freq_factor=params["high_freq_factor"], original_max_len=params["original_max_position_embeddings"],
        )  # fmt: skip
    raise ModelImportError(f"{where}: rope_type {kind!r} is not supported (default, linear, llama3)")


def _global_rope(hf: dict[str, Any], where: str) -> dict[str, Any]:
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:
        return params["full_attention"]
    if isinstance(params, dict):
        return params
    legacy = dict(hf.get("rope_scaling") or {})
    return {**legacy, "rope_theta": hf.get("rope_theta", 10000.0)}


def _layer_types(hf: dict[str, Any], n_layers: int) -> tuple[str, ...] | None:
    if hf.get("layer_types"):
        return tuple(hf["layer_types"])
    if hf["model_type"] == "gemma3_text":  # transformers 4: every Nth layer is global
        pattern = int(hf.get("sliding_window_pattern", 6))
        return tuple("full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n_layers))
    if hf.get("use_sliding_window") and hf.get("sliding_window"):  # Qwen2/3 convention
        first = int(hf.get("max_window_layers", n_layers))
        return tuple("sliding_attention" if i >= first else "full_attention" for i in range(n_layers))
    return None


def _family_switches(hf: dict[str, Any], where: str) -> dict[str, Any]:
    """The ModelConfig switches one family implies."""
    arch = hf["model_type"]
    bias = bool(hf.get("attention_bias", False))
    if hf.get("mlp_bias"):
        raise ModelImportError(f"{where}: mlp_bias=true is not supported")
    if arch == "llama":
        return dict(qkv_bias=bias, o_bias=bias)
    if arch == "qwen2":
        return dict(qkv_bias=True)
    if arch == "qwen3":
        return dict(qkv_bias=bias, o_bias=bias, qk_norm=True)
    if hf.get("use_bidirectional_attention"):
        raise ModelImportError(f"{where}: use_bidirectional_attention=true (an embedding model) is not supported")
    local = (hf.get("rope_parameters") or {}).get("sliding_attention") or {}
    return dict(
        qkv_bias=bias, o_bias=bias, qk_norm=True, norm_offset_one=True, post_norms=True, embed_scale=True,
        query_pre_attn_scalar=hf.get("query_pre_attn_scalar", 256),
        rope_local_theta=float(local.get("rope_theta", hf.get("rope_local_base_freq", 10000.0))),
        # transformers' Gemma 3 stores attn_logit_softcapping but never applies it; neither do we.
        final_softcap=hf.get("final_logit_softcapping"),
    )  # fmt: skip


def _activation(hf: dict[str, Any], where: str) -> str:
    name = hf.get("hidden_activation") or hf.get("hidden_act") or "silu"
    if name not in _ACTS:
        raise ModelImportError(f"{where}: activation {name!r} is not supported ({', '.join(_ACTS)})")
    return _ACTS[name]


def hf_config_to_model_config(config_json: dict[str, Any] | str | Path, max_len: int | None = None) -> ModelConfig:
    """The ``ModelConfig`` of a Hugging Face ``config.json`` (a dict, its path, or its directory).

    ``max_len`` is the context needle trains and decodes with (``needle.config.imported_max_len``:
    default 2048, capped by the model's ``max_position_embeddings``). The original
    config travels along in ``ModelConfig.hf_config`` so an export writes it back.
    """
    where = "config.json"
    if not isinstance(config_json, dict):
        path = Path(config_json)
        path = path / "config.json" if path.is_dir() else path
        where = str(path)
        try:
            config_json = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as e:
            raise ModelImportError(f"{where}: cannot read a Hugging Face config: {e}") from e
    hf = config_json
    arch = hf.get("model_type")
    if arch not in SUPPORTED_ARCHS:
        raise ModelImportError(f"{where}: model_type {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHS)}")
    try:
        n_layers, n_heads = int(hf["num_hidden_layers"]), int(hf["num_attention_heads"])
        theta, scaling = _rope(_global_rope(hf, where), where)
        layer_types = _layer_types(hf, n_layers)
        sliding = layer_types is not None and "sliding_attention" in layer_types
        return ModelConfig(
            preset=f"hf:{arch}", arch=arch, vocab_size=hf["vocab_size"], d_model=hf["hidden_size"],
            n_layers=n_layers, n_heads=n_heads, n_kv_heads=hf.get("num_key_value_heads") or n_heads,
            head_dim=hf.get("head_dim") or None, d_ff=hf["intermediate_size"],
            max_len=imported_max_len(max_len, hf.get("max_position_embeddings")),
            rope_theta=theta, rope_scaling=scaling, norm_eps=hf.get("rms_norm_eps", 1e-6),
            tie_embeddings=hf.get("tie_word_embeddings", arch == "gemma3_text"), mlp_act=_activation(hf, where),
            layer_types=layer_types, sliding_window=hf.get("sliding_window") if sliding else None,
            hf_config=json.dumps(hf, separators=(",", ":")), **_family_switches(hf, where),
        )  # fmt: skip
    except KeyError as e:
        raise ModelImportError(f"{where}: missing key {e.args[0]!r} for model_type {arch!r}") from e
    except ValueError as e:
        raise ModelImportError(f"{where}: does not make a valid needle config: {e}") from e
