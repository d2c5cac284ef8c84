"""What every tokenizer shares: the special tokens, file names, the protocol and the raw-ids base.

The lowest tokenizer layer. needle's own BPE (needle/tokenizers/native.py), a Hugging Face model's
tokenizer (needle/tokenizers/hf.py) and Needle 3's SentencePiece tokenizer
(needle/tokenizers/needle3.py) import from here; ``needle.tokenizers.native`` re-exports every name, and
its ``load_tokenizer`` picks among them, so the imports point one way (down to this module).

    from needle.tokenizers.base import TOKENIZER_FILE, TokenizerLike
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Protocol, runtime_checkable

from tokenizers import Tokenizer as RawTokenizer

SPECIAL_TOKENS: tuple[str, ...] = (
    "<|pad|>",
    "<|bos|>",
    "<|end|>",
    "<|system|>",
    "<|tools|>",
    "<|user|>",
    "<|assistant|>",
    "<|think|>",
    "<|call|>",
)
# The same tokens by role, so the template (needle/data/render.py) and the parser
# (needle/data/parse.py) never spell them out again.
PAD, BOS, END, SYSTEM, TOOLS, USER, ASSISTANT, THINK, CALL = SPECIAL_TOKENS
TOKENIZER_FILE = "tokenizer.json"
SP_MODEL_FILE = "tokenizer.model"  # Needle 3's SentencePiece model (needle/tokenizers/needle3.py)


@runtime_checkable
class TokenizerLike(Protocol):
    """What the data, training and eval code need from a tokenizer (native or Hugging Face)."""

    @property
    def vocab_size(self) -> int: ...
    @property
    def pad_id(self) -> int: ...
    @property
    def end_id(self) -> int: ...
    @property
    def stop_ids(self) -> tuple[int, ...]: ...
    @property
    def chat_template(self) -> str | None: ...
    def token_id(self, tok: str) -> int: ...
    def encode(self, text: str) -> list[int]: ...
    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...
    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str: ...
    def to_json(self) -> str: ...
    def save(self, directory: str | Path) -> Path: ...


class RawTokenIds:
    """Ids and text over a ``tokenizers.Tokenizer`` in ``self._raw``: what both wrappers share.

    Text is always encoded without the tokenizer's own special-token post-processing: every
    chat template writes its special tokens itself.
    """

    _raw: RawTokenizer

    @property
    def vocab_size(self) -> int:
        return self._raw.get_vocab_size(with_added_tokens=True)

    def token_id(self, tok: str) -> int:
        """Id of one token string (special or ordinary); KeyError if it is not in the vocab."""
        got = self._raw.token_to_id(tok)
        if got is None:
            raise KeyError(f"token {tok!r} is not in the vocabulary")
        return got

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; special tokens written in the text become their ids."""
        return list(self._raw.encode(text, add_special_tokens=False).ids)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """``encode`` over many texts at once (parallel inside ``tokenizers``)."""
        return [list(e.ids) for e in self._raw.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text of ``ids``; exact inverse of :meth:`encode` unless ``skip_special``."""
        return self._raw.decode([int(i) for i in ids], skip_special_tokens=skip_special)
