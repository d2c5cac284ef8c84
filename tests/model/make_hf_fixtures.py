"""Tiny random Hugging Face models (Llama, Qwen2, Qwen3, Gemma 3) and their transformers outputs.

Used two ways:

- by the torch-tier tests (``pytest -m torch tests/model``), which build float32 models on the
  fly with :func:`build_model` and compare needle with :func:`reference_logits` /
  :func:`reference_greedy`;
- as a script that regenerates the committed golden fixtures under
  tests/model/fixtures/hf/<arch>/ (bf16 weights, so the four stay a few hundred KB; the
  expected outputs are transformers' float32 run on those bf16-rounded weights), which the
  default tier checks without torch::

      HF_HUB_OFFLINE=1 .venv/bin/python tests/model/make_hf_fixtures.py

Everything is offline: configs are built in code, weights are seeded random.
torch/transformers are imported inside the functions, so the default tier can import the
constants of this module without them.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
VOCAB = 384
_COMMON = dict(
    vocab_size=VOCAB, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
    pad_token_id=0,
)  # fmt: skip
# Each spec exercises its family's switches: llama untied with llama3 RoPE scaling (an
# original context of 16 so every frequency band is hit at these positions); qwen2 q/k/v
# biases; qwen3 a head_dim (16) that is not hidden/heads (12); gemma3_text sliding and full
# layers with a window (4) shorter than the test prompts, and query_pre_attn_scalar != head_dim.
SPECS: dict[str, dict[str, Any]] = {
    "llama": dict(
        _COMMON, model_type="llama", tie_word_embeddings=False,
        rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position_embeddings=16),
    ),
    "qwen2": dict(_COMMON, model_type="qwen2", tie_word_embeddings=True),
    "qwen3": dict(_COMMON, model_type="qwen3", tie_word_embeddings=True, head_dim=16),
    "gemma3_text": dict(
        _COMMON, model_type="gemma3_text", tie_word_embeddings=True, head_dim=16, num_hidden_layers=3,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], sliding_window=4,
        query_pre_attn_scalar=24,
    ),
}  # fmt: skip
# Soft caps (None in Gemma 3): transformers applies the final one and ignores the attention one
# for Gemma 3, and the importer does the same. Torch tier only.
EXTRA_SPECS = {
    "gemma3_softcap": dict(SPECS["gemma3_text"], attn_logit_softcapping=5.0, final_logit_softcapping=3.0),
}
LENGTHS = (12, 7)  # the padded batch: row 1 is right-padded with pad id 0
N_NEW = 20


def tokens_and_lengths(seed: int = 0) -> tuple[np.ndarray, list[int]]:
    """The padded batch ``int32[2, 12]`` (ids clear of the first specials) and its real lengths."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(3, VOCAB, size=(len(LENGTHS), max(LENGTHS))).astype(np.int32)
    for row, n in enumerate(LENGTHS):
        tokens[row, n:] = 0
    return tokens, list(LENGTHS)


def build_model(name: str, out_dir: Path, *, seed: int = 0, dtype: str = "float32") -> Any:
    """Build the named tiny model with seeded random weights, ``save_pretrained`` it; return it (f32)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(SPECS.get(name) or EXTRA_SPECS[name])
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    config._attn_implementation = "eager"  # soft caps need the eager path; one path for all
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for key, p in model.named_parameters():
            # Big enough weights that logits are far from uniform (greedy ties are unlikely),
            # and non-trivial norms and biases so (1 + w) norms and biases are really tested.
            std = 0.1 if (key.endswith("norm.weight") or key.endswith(".bias")) else 0.2
            p.copy_(torch.randn_like(p) * std + (1.0 if key.endswith("norm.weight") and "gemma" not in name else 0.0))
            if dtype == "bfloat16":
                p.copy_(p.to(torch.bfloat16).to(torch.float32))
    # Save a converted copy: .to() would also round the float32 RoPE buffers of ``model``.
    copy.deepcopy(model).to(getattr(torch, dtype)).save_pretrained(out_dir)
    model.generation_config.save_pretrained(out_dir)
    return model


def reference_logits(model: Any, tokens: np.ndarray, lengths: list[int]) -> np.ndarray:
    """transformers' float32 logits ``[B, T, V]`` of the right-padded batch (pads masked)."""
    import torch

    mask = (np.arange(tokens.shape[1])[None, :] < np.asarray(lengths)[:, None]).astype(np.int64)
    with torch.no_grad():
        out = model(input_ids=torch.from_numpy(tokens.astype(np.int64)), attention_mask=torch.from_numpy(mask))
    return out.logits.float().numpy()


def reference_greedy(model: Any, prompts: list[list[int]], n_new: int = N_NEW) -> list[list[int]]:
    """``generate(do_sample=False)`` of each prompt, exactly ``n_new`` tokens (no end token)."""
    import torch

    model.generation_config.eos_token_id = None
    results = []
    for prompt in prompts:
        ids = torch.tensor([prompt], dtype=torch.long)
        with torch.no_grad():
            out = model.generate(ids, do_sample=False, max_new_tokens=n_new, min_new_tokens=n_new, pad_token_id=0)
        results.append(out[0, len(prompt) :].tolist())
    return results


def write_tokenizer(out_dir: Path) -> None:
    """A small byte-level BPE tokenizer (HF layout) under the model's vocab size, offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<pad>", "<bos>", "<eos>"]
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["call the weather tool for Paris", "what is the time in Tokyo?"] * 50, trainer)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    tok.save(str(Path(out_dir) / "tokenizer.json"))
    config = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "tokenizer_class": "PreTrainedTokenizerFast"}
    (Path(out_dir) / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")


def write_fixture(name: str, root: Path = FIXTURES) -> Path:
    """One golden fixture: bf16 checkpoint + expected logits (real positions) + greedy tokens."""
    out = root / name
    model = build_model(name, out, dtype="bfloat16")
    tokens, lengths = tokens_and_lengths()
    logits = reference_logits(model, tokens, lengths)
    real = np.concatenate([logits[row, :n] for row, n in enumerate(lengths)]).astype(np.float32)
    np.save(out / "expected_logits.npy", real, allow_pickle=False)
    prompts = [tokens[row, :n].tolist() for row, n in enumerate(lengths)]
    expected = {"tokens": tokens.tolist(), "lengths": lengths, "greedy": reference_greedy(model, prompts)}
    (out / "expected.json").write_text(json.dumps(expected) + "\n", encoding="utf-8")
    return out


def main() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    for name in sys.argv[1:] or SPECS:
        out = write_fixture(name)
        size = sum(p.stat().st_size for p in out.iterdir())
        print(f"{out}: {size / 1024:.0f} KB")


if __name__ == "__main__":
    main()
