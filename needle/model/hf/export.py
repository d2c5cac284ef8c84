"""Export to the Hugging Face ecosystem: a merged model transformers loads, or a PEFT adapter.

    export_hf(load_model("runs/tuned/model"), None, None, "out/hf")       # config, safetensors, tokenizer
    export_peft(lora_params, lora_cfg, loaded_base.meta["base"], "out/adapter")

``export_hf`` writes ``config.json`` (the imported model's original config, or a Llama config
for a native needle model, which is exactly a Llama: RMSNorm, half-split RoPE, SiLU gated MLP,
no biases), ``generation_config.json``, ``model.safetensors`` and the tokenizer's files. Weights
are cast to the original checkpoint's dtype, so an imported model exported untouched gives back
its tensors bit for bit. ``export_peft`` writes ``adapter_config.json`` and
``adapter_model.safetensors`` with PEFT's key names; PEFT's scale ``lora_alpha / r`` equals
needle's ``alpha / rank``. Both write into a temp directory renamed into place when complete.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import jax.numpy as jnp
from flax import traverse_util

from needle.config import LoraConfig, ModelConfig
from needle.errors import ModelImportError
from needle.model.hf.config import HF_CLASSES
from needle.model.hf.weights import SINGLE_FILE, params_to_hf_tensors
from needle.model.layout import _swap_in
from needle.model.lora import Params

# Switches a Llama checkpoint cannot express; a needle-arch config using any is not a Llama.
_NOT_LLAMA = ("qk_norm", "norm_offset_one", "post_norms", "embed_scale", "rope_local_theta", "sliding_window",
              "query_pre_attn_scalar", "attn_softcap", "final_softcap")  # fmt: skip
_HF_BLOCK = {"attn": "self_attn", "mlp": "mlp"}


def _llama_config(cfg: ModelConfig, tokenizer: Any) -> dict[str, Any]:
    """A LlamaForCausalLM config equivalent to a native needle config, or an error naming why not."""
    odd = [name for name in _NOT_LLAMA if getattr(cfg, name) not in (None, False)]
    odd += ["mlp_act"] * (cfg.mlp_act != "silu") + ["qkv_bias != o_bias"] * (cfg.qkv_bias != cfg.o_bias)
    if odd:
        raise ModelImportError(f"this {cfg.arch} config is not exactly a Llama ({', '.join(odd)}): cannot export it to HF")
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        rs = cfg.rope_scaling
        rope = {"rope_type": rs.type, "rope_theta": cfg.rope_theta, "factor": rs.factor}
        if rs.type == "llama3":
            rope.update(low_freq_factor=rs.low_freq_factor, high_freq_factor=rs.high_freq_factor,
                        original_max_position_embeddings=rs.original_max_len)  # fmt: skip
    ids = {name: getattr(tokenizer, attr, None) for name, attr in
           (("bos_token_id", "bos_id"), ("eos_token_id", "end_id"), ("pad_token_id", "pad_id"))}  # fmt: skip
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model, "intermediate_size": cfg.d_ff, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_len, "rms_norm_eps": cfg.norm_eps, "hidden_act": "silu",
        "attention_bias": cfg.qkv_bias, "mlp_bias": False, "tie_word_embeddings": cfg.tie_embeddings,
        "rope_parameters": rope, "dtype": "float32", **ids,
    }  # fmt: skip


def model_config_to_hf_config(cfg: ModelConfig, tokenizer: Any = None) -> dict[str, Any]:
    """The HF ``config.json`` of ``cfg``: the imported original, or a Llama config for native needle."""
    if cfg.hf_config is None:
        if cfg.arch not in ("needle", "llama"):
            raise ModelImportError(f"{cfg.arch} config has no original Hugging Face config (hf_config) to write back")
        return _llama_config(cfg, tokenizer)
    hf = json.loads(cfg.hf_config)
    shape = {"vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "num_hidden_layers": cfg.n_layers,
             "intermediate_size": cfg.d_ff, "num_attention_heads": cfg.n_heads}  # fmt: skip
    changed = {k: (hf.get(k), v) for k, v in shape.items() if hf.get(k) != v}
    if changed:
        raise ModelImportError(f"hf_config disagrees with the model config on {changed}: cannot export it")
    hf.setdefault("architectures", [HF_CLASSES[cfg.arch]])
    return hf


def _generation_config(hf: dict[str, Any]) -> dict[str, Any]:
    keys = ("bos_token_id", "eos_token_id", "pad_token_id")
    return {k: hf[k] for k in keys if hf.get(k) is not None}


def _staged(out_dir: str | Path) -> tuple[Path, Path]:
    target = Path(out_dir).absolute()
    target.parent.mkdir(parents=True, exist_ok=True)
    return target, Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))


def _finish(staged: Path, target: Path) -> Path:
    _swap_in(staged, target)
    return target


def _save_safetensors(tensors: dict[str, Any], path: Path) -> None:
    from safetensors.flax import save_file

    # transformers refuses safetensors files without format metadata.
    save_file({k: jnp.asarray(v) for k, v in tensors.items()}, str(path), metadata={"format": "pt"})


def export_hf(
    model: Any, cfg: ModelConfig | None, tokenizer: Any, out_dir: str | Path, *, dtype: str | None = None
) -> Path:
    """Write ``model`` (a ``LoadedModel`` or merged params) as a Hugging Face model directory.

    ``cfg``/``tokenizer`` default to the ``LoadedModel``'s. ``dtype`` defaults to the imported
    checkpoint's (``dtype``/``torch_dtype`` in its config), else float32.
    """
    params = getattr(model, "params", model)
    cfg = cfg or getattr(model, "model_cfg", None)
    tokenizer = tokenizer if tokenizer is not None else getattr(model, "tokenizer", None)
    if cfg is None:
        raise ValueError("export_hf: pass the ModelConfig of these params")
    hf = model_config_to_hf_config(cfg, tokenizer)
    dtype = dtype or hf.get("dtype") or hf.get("torch_dtype") or "float32"
    tensors = params_to_hf_tensors(params, cfg, jnp.dtype(dtype))
    hf = {**{k: v for k, v in hf.items() if k != "torch_dtype"}, "dtype": str(jnp.dtype(dtype))}
    target, staged = _staged(out_dir)
    try:
        _save_safetensors(tensors, staged / SINGLE_FILE)
        (staged / "config.json").write_text(json.dumps(hf, indent=2), encoding="utf-8")
        (staged / "generation_config.json").write_text(json.dumps(_generation_config(hf), indent=2), encoding="utf-8")
        if tokenizer is not None:
            tokenizer.save(staged)
        return _finish(staged, target)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise


def peft_tensors(lora_params: Params) -> tuple[dict[str, Any], list[str]]:
    """``({peft_key: tensor}, target module names)`` of every ``lora_a``/``lora_b`` pair."""
    tensors, targets = {}, set()
    for path, leaf in traverse_util.flatten_dict(lora_params).items():
        if path[-1] not in ("lora_a", "lora_b"):
            continue
        block, kind, proj = path[-4:-1]
        if not block.startswith("block_") or kind not in _HF_BLOCK:
            raise ModelImportError(f"export_peft: unexpected adapter at {'/'.join(path)}")
        name = f"base_model.model.model.layers.{block[len('block_'):]}.{_HF_BLOCK[kind]}.{proj}"
        # needle: x·A·B with A [in, r], B [r, out]; PEFT: lora_A.weight [r, in], lora_B.weight [out, r].
        ab = "lora_A" if path[-1] == "lora_a" else "lora_B"
        tensors[f"{name}.{ab}.weight"] = jnp.asarray(leaf, jnp.float32).T
        targets.add(proj)
    if not tensors:
        raise ModelImportError("export_peft: the params have no lora_a/lora_b leaves")
    return tensors, sorted(targets)


def export_peft(lora_params: Params, lora_cfg: LoraConfig, base_source: Any, out_dir: str | Path) -> Path:
    """Write the adapters as a PEFT LoRA adapter (for ``PeftModel.from_pretrained(base, out_dir)``).

    ``base_source``: the base's ``meta["base"]`` dict (source, revision) or a path / hub id.
    """
    tensors, targets = peft_tensors(lora_params)
    base = base_source if isinstance(base_source, dict) else {"source": str(base_source)}
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base.get("source"),
        "revision": base.get("revision"), "r": lora_cfg.rank, "lora_alpha": lora_cfg.alpha,
        "target_modules": targets, "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
        "use_rslora": False, "use_dora": False, "init_lora_weights": True, "inference_mode": True,
        "modules_to_save": None,
    }  # fmt: skip
    target, staged = _staged(out_dir)
    try:
        _save_safetensors(tensors, staged / "adapter_model.safetensors")
        (staged / "adapter_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
        return _finish(staged, target)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
