"""A GGUF SentencePiece vocabulary (``tokenizer.ggml.model`` ``llama``: Gemma 3, Llama 2) as a
Hugging Face ``tokenizers`` BPE, the way transformers converts a SentencePiece model.

llama.cpp keeps such a tokenizer as pieces, scores and token types; its tokenizer merges, within
the text (spaces written ``▁``, a ``▁`` prepended when ``tokenizer.ggml.add_space_prefix``), the
adjacent pair whose joined piece scores highest, and spells what no piece covers as ``<0xNN>``
byte tokens. The same as a BPE: every piece split in two known pieces is a merge, ranked by the
joined piece's score (transformers' ``SentencePieceExtractor``), with byte fallback and no
pre-tokenizer. Checked against ``sentencepiece`` itself in tests/model/test_gguf_import.py.

    text = spm_tokenizer_json(tokens, scores, types, add_space_prefix=False, unk=3)
"""

from __future__ import annotations

import json
from typing import Any

# llama.cpp token types (tokenizer.ggml.token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED = 1, 2, 3, 4
_SPACE = "\u2581"  # ▁, SentencePiece's space


def _merges(tokens: list[str], scores: list[float], types: list[int]) -> list[list[str]]:
    vocab = {t: i for i, t in enumerate(tokens)}
    found: list[tuple[float, int, int, str, str]] = []
    for piece, score, kind in zip(tokens, scores, types):
        if kind != NORMAL:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                found.append((-float(score), vocab[left], vocab[right], left, right))
    found.sort()  # highest score first; a piece's own splits by the ids of their parts
    return [[left, right] for _, _, _, left, right in found]


def added_tokens(tokens: list[str], types: list[int]) -> list[dict[str, Any]]:
    """``tokenizer.json``'s added tokens: control (and unknown) tokens special, user-defined ones not;
    both matched whole in text, never split."""
    return [
        {"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
         "special": kind != USER_DEFINED}
        for i, (t, kind) in enumerate(zip(tokens, types)) if kind in (UNKNOWN, CONTROL, USER_DEFINED)
    ]  # fmt: skip


def spm_tokenizer_json(tokens: list[str], scores: list[float], types: list[int], add_space_prefix: bool,
                       unk: int | None) -> str:  # fmt: skip
    """The ``tokenizer.json`` text of a SentencePiece BPE vocabulary (module doc)."""
    normalizers: list[dict[str, Any]] = [{"type": "Prepend", "prepend": _SPACE}] if add_space_prefix else []
    normalizers.append({"type": "Replace", "pattern": {"String": " "}, "content": _SPACE})
    decoders: list[dict[str, Any]] = [{"type": "Replace", "pattern": {"String": _SPACE}, "content": " "},
                                      {"type": "ByteFallback"}, {"type": "Fuse"}]  # fmt: skip
    if add_space_prefix:
        decoders.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
    model = {"type": "BPE", "dropout": None, "unk_token": tokens[unk] if unk is not None and 0 <= unk < len(tokens) else None,
             "continuing_subword_prefix": None, "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True,
             "ignore_merges": False, "vocab": {t: i for i, t in enumerate(tokens)},
             "merges": _merges(tokens, scores, types)}  # fmt: skip
    return json.dumps({
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added_tokens(tokens, types),
        "normalizer": {"type": "Sequence", "normalizers": normalizers}, "pre_tokenizer": None,
        "post_processor": None, "decoder": {"type": "Sequence", "decoders": decoders}, "model": model,
    }, ensure_ascii=False)  # fmt: skip
