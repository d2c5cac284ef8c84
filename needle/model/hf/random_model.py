"""Tiny random Hugging Face models (Qwen3, Qwen2, Llama, Gemma 3) for demos and tests, offline.

No weights can be downloaded here, so the pretrained-model path is exercised on models made
locally in the exact layout a hub snapshot has: ``config.json``, ``model.safetensors``,
``generation_config.json``, ``tokenizer.json`` (a byte-level BPE trained on the given rows with
the family's real special tokens), ``tokenizer_config.json`` and ``chat_template.jinja`` (a
template in the family's format, from needle/data/templates/). The weights are needle's own
random init written through ``export_hf``, so transformers loads the directory as it is.

    needle sample-model /tmp/tiny-qwen3 --arch qwen3 --data data/sample/new.jsonl
    needle finetune data/sample/new.jsonl --base /tmp/tiny-qwen3

``--shape`` gives the model a real model's shape with random weights (the tokenizer stays a
small BPE; the config's ``vocab_size`` is the shape's, the embedding rows past the tokenizer
unused): a preset of :data:`SHAPES` (``smollm2-135m``, ``qwen3-0.6b``, ``gemma3-270m``, whose
family sets ``--arch``) or the family's ``config.json`` keys, ``key=value,...`` or a JSON object:

    needle sample-model /tmp/llama-135m --shape smollm2-135m
    needle sample-model /tmp/wide --arch qwen3 --shape hidden_size=256,num_hidden_layers=4
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from needle.model.hf.config import hf_config_to_model_config
from needle.model.hf.export import export_hf
from needle.model.lora import init_params
from needle.tokenizers.hf import HFTokenizer

TEMPLATES = Path(__file__).resolve().parents[2] / "data" / "templates"
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

# Qwen/Qwen3-0.6B's keys, which Qwen3-1.7B shares but for its width.
_QWEN3_06B = dict(
    model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
    num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
    rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
)  # fmt: skip

# Real models' shapes (their config.json keys; weights random): the benchmark's memory section
# (bench/memory.py) and ``needle sample-model --shape NAME``.
SHAPES: dict[str, dict[str, Any]] = {
    # HuggingFaceTB/SmolLM2-135M: the "135M Llama" of issue 20.
    "smollm2-135m": dict(
        model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
        rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True,
    ),
    # Qwen/Qwen3-0.6B
    "qwen3-0.6b": _QWEN3_06B,
    # Qwen/Qwen3-1.7B
    "qwen3-1.7b": dict(_QWEN3_06B, hidden_size=2048, intermediate_size=6144),
    # google/gemma-3-270m: five sliding-window (512) layers to one global layer.
    "gemma3-270m": dict(
        model_type="gemma3_text", vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
        num_attention_heads=4, num_key_value_heads=1, head_dim=256, max_position_embeddings=32768,
        rms_norm_eps=1e-6, rope_theta=1000000.0, rope_local_base_freq=10000.0, sliding_window=512,
        query_pre_attn_scalar=256, tie_word_embeddings=True,
        layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)],
    ),
}  # fmt: skip


def parse_shape(text: str | dict[str, Any] | None) -> dict[str, Any] | None:
    """``--shape``: a :data:`SHAPES` name, a JSON object, or ``key=value,...`` (values as JSON when
    they parse, else strings); None stays None."""
    if text is None or isinstance(text, dict):
        return text
    text = text.strip()
    if text in SHAPES:
        return dict(SHAPES[text])
    if text.startswith("{"):
        return dict(json.loads(text))
    out: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--shape: {part!r} is not key=value (or use one of {sorted(SHAPES)})")
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value.strip()
    return out


def shape_config(shape: str | dict[str, Any], arch: str | None = None, vocab_size: int | None = None) -> dict[str, Any]:
    """The full ``config.json`` of a shape (preset name or keys over ``hf_config``'s defaults)."""
    keys = parse_shape(shape) or {}
    arch = keys.get("model_type") or arch or "qwen3"
    vocab = int(keys.get("vocab_size") or vocab_size or 1024)
    base = hf_config(arch, vocab, d_model=int(keys.get("hidden_size", 64)), n_layers=int(keys.get("num_hidden_layers", 2)))
    if "head_dim" not in keys and "num_attention_heads" in keys:
        base["head_dim"] = int(base["hidden_size"]) // int(keys["num_attention_heads"])
    return {**base, **keys}


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
    d_model: int = 64, n_layers: int = 2, seed: int = 0, shape: str | dict[str, Any] | None = None,
) -> Path:  # fmt: skip
    """Write a random ``arch`` model with a tokenizer trained on ``data``; return its directory.

    ``shape`` (module doc) sets the model's shape (and, for a preset, its arch); ``vocab_size`` is
    then the tokenizer's, the model's is the shape's (never smaller than the tokenizer's)."""
    keys = parse_shape(shape)
    if keys and keys.get("model_type"):
        arch = keys["model_type"]

    family = FAMILY_OF_ARCH.get(arch)
    if family is None:
        raise ValueError(f"unknown arch {arch!r}; choose one of {sorted(FAMILY_OF_ARCH)}")
    spec = FAMILIES[family]
    raw = train_family_tokenizer(_texts(data), family, vocab_size)
    ids = {t: raw.token_to_id(t) for t in spec["specials"]}
    eos = [ids[t] for t in spec["generation_eos"]]
    named = {k: ids.get(v) for k, v in spec["config"].items() if isinstance(v, str)}
    if keys:
        config = shape_config({**keys, "model_type": arch}, arch, raw.get_vocab_size())
        if int(config["vocab_size"]) < raw.get_vocab_size():
            raise ValueError(f"shape vocab_size={config['vocab_size']} is below the tokenizer's {raw.get_vocab_size()}")
    else:
        config = hf_config(arch, raw.get_vocab_size(), d_model=d_model, n_layers=n_layers)
    config.update(eos_token_id=eos, bos_token_id=named.get("bos_token"), pad_token_id=named.get("pad_token"))
    tokenizer = HFTokenizer(raw, config=dict(spec["config"]), chat_template=family_template(family), generation_eos=eos)
    cfg = hf_config_to_model_config(config)
    out = export_hf(init_params(cfg, None, seed), cfg, tokenizer, out_dir, dtype="float32")
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}, indent=2), encoding="utf-8")
    return out
