"""Tiny random Hugging Face models (Qwen3, Qwen2, Llama, Gemma 3) for demos and tests, offline.

No weights can be downloaded here, so the pretrained-model path is exercised on models made
locally in the exact layout a hub snapshot has: ``config.json``, ``model.safetensors``,
``generation_config.json``, ``tokenizer.json`` (a byte-level BPE trained on the given rows with
the family's real special tokens), ``tokenizer_config.json`` and ``chat_template.jinja`` (a
template in the family's format, from needle/data/templates/). The weights are needle's own
random init written through ``export_hf``, so transformers loads the directory as it is.

    needle sample-model /tmp/tiny-qwen3 --arch qwen3 --data data/sample/new.jsonl
    needle finetune data/sample/new.jsonl --base /tmp/tiny-qwen3
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

TEMPLATES = Path(__file__).resolve().parents[1] / "data" / "templates"
# Per template family: the real vocabulary's special tokens, tokenizer_config's named tokens and
# generation_config's eos tokens (transformers stops at any of them).
FAMILIES: dict[str, dict[str, Any]] = {
    "qwen3": {
        "specials": ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<think>",
                     "</think>"],  # fmt: skip
        "config": {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "add_bos_token": False},
        "generation_eos": ["<|im_end|>", "<|endoftext|>"],
    },
    "llama3": {
        "specials": ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                     "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"],  # fmt: skip
        "config": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "add_bos_token": True},
        "generation_eos": ["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"],
    },
    "gemma3": {
        "specials": ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"],
        "config": {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>",
                   "add_bos_token": True},  # fmt: skip
        "generation_eos": ["<eos>", "<end_of_turn>"],
    },
}
FAMILY_OF_ARCH = {"qwen3": "qwen3", "qwen2": "qwen3", "llama": "llama3", "gemma3_text": "gemma3"}


def family_template(family: str) -> str:
    """The shipped chat template of a family (``qwen3``, ``llama3``, ``gemma3``)."""
    return (TEMPLATES / f"{family}.jinja").read_text(encoding="utf-8")


def train_family_tokenizer(texts: Iterable[str], family: str, vocab_size: int) -> Any:
    """A byte-level BPE (raw ``tokenizers.Tokenizer``) with the family's special tokens first."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=FAMILIES[family]["specials"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )  # fmt: skip
    raw.train_from_iterator(list(texts), trainer=trainer)
    return raw


def hf_config(arch: str, vocab_size: int, *, d_model: int = 64, n_layers: int = 2, max_len: int = 2048) -> dict[str, Any]:
    """A small ``config.json`` of ``arch`` that exercises its family's switches."""
    common = dict(
        model_type=arch, vocab_size=vocab_size, hidden_size=d_model, intermediate_size=2 * d_model,
        num_hidden_layers=n_layers, num_attention_heads=4, num_key_value_heads=2, head_dim=d_model // 4,
        max_position_embeddings=max_len, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=True,
    )  # fmt: skip
    if arch == "llama":
        return {**common, "tie_word_embeddings": False, "hidden_act": "silu"}
    if arch == "gemma3_text":
        kinds = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n_layers)]
        return {**common, "layer_types": kinds, "sliding_window": 128, "query_pre_attn_scalar": d_model // 4,
                "hidden_activation": "gelu_pytorch_tanh"}  # fmt: skip
    if arch in ("qwen2", "qwen3"):
        return {**common, "hidden_act": "silu"}
    raise ValueError(f"unknown arch {arch!r}; choose one of {sorted(FAMILY_OF_ARCH)}")


def _texts(data: str | Path | None) -> list[str]:
    """Training text for the BPE: the raw JSONL lines (queries, tool schemas, calls)."""
    if data is None:
        return ["Given the following functions, call the right one."]
    return Path(data).read_text(encoding="utf-8").splitlines()


def write_random_hf_model(
    out_dir: str | Path, arch: str = "qwen3", *, data: str | Path | None = None, vocab_size: int = 1024,
    d_model: int = 64, n_layers: int = 2, seed: int = 0,
) -> Path:  # fmt: skip
    """Write a random ``arch`` model with a tokenizer trained on ``data``; return its directory."""
    from needle.hf_tokenizer import HFTokenizer
    from needle.model.hf import hf_config_to_model_config
    from needle.model.hf_export import export_hf
    from needle.model.lora import init_params

    family = FAMILY_OF_ARCH.get(arch)
    if family is None:
        raise ValueError(f"unknown arch {arch!r}; choose one of {sorted(FAMILY_OF_ARCH)}")
    spec = FAMILIES[family]
    raw = train_family_tokenizer(_texts(data), family, vocab_size)
    ids = {t: raw.token_to_id(t) for t in spec["specials"]}
    eos = [ids[t] for t in spec["generation_eos"]]
    named = {k: ids.get(v) for k, v in spec["config"].items() if isinstance(v, str)}
    config = hf_config(arch, raw.get_vocab_size(), d_model=d_model, n_layers=n_layers)
    config.update(eos_token_id=eos, bos_token_id=named.get("bos_token"), pad_token_id=named.get("pad_token"))
    tokenizer = HFTokenizer(raw, config=dict(spec["config"]), chat_template=family_template(family), generation_eos=eos)
    cfg = hf_config_to_model_config(config)
    out = export_hf(init_params(cfg, None, seed), cfg, tokenizer, out_dir, dtype="float32")
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}, indent=2), encoding="utf-8")
    return out
