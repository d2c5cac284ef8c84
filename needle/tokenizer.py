"""Byte-level BPE tokenizer: training, encode/decode, and tokenizer.json persistence.

Built on Hugging Face ``tokenizers`` (the reference BPE implementation). Byte-level means
every UTF-8 string encodes without unknown tokens and decodes back byte for byte. The chat
template's special tokens (``SPECIAL_TOKENS``) always take ids 0..8 in the documented order.

    tok = train_tokenizer(texts, vocab_size=1024)
    tok.save("out/")                      # writes out/tokenizer.json (JSON, never pickle)
    tok = Tokenizer.load("out/")
    assert tok.decode(tok.encode("héllo 🎉")) == "héllo 🎉"
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Regex
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

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
TOKENIZER_FILE = "tokenizer.json"
# A word with the punctuation that follows it, a single digit, a punctuation run, or whitespace.
# Digits stay single tokens: a small model copies "K33026" or "472.18" from the query into the
# call far more reliably when every number is spelt the same way, digit by digit.
PRE_TOKEN_PATTERN = r" ?\p{L}+[^\s\p{L}\p{N}]*| ?\p{N}| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"


class Tokenizer:
    """A thin, typed wrapper over an HF byte-level BPE ``tokenizers.Tokenizer``."""

    def __init__(self, hf: HFTokenizer) -> None:
        self._hf = hf
        self._check_specials()

    def _check_specials(self) -> None:
        # The template and the model code hard-wire pad=0 etc.; a tokenizer with other ids
        # would train silently wrong, so refuse it here.
        for expected, tok in enumerate(SPECIAL_TOKENS):
            got = self._hf.token_to_id(tok)
            if got != expected:
                raise ValueError(f"special token {tok} has id {got}, expected {expected}")

    @property
    def vocab_size(self) -> int:
        return self._hf.get_vocab_size(with_added_tokens=True)

    @property
    def pad_id(self) -> int:
        return SPECIAL_TOKENS.index("<|pad|>")

    @property
    def bos_id(self) -> int:
        return SPECIAL_TOKENS.index("<|bos|>")

    @property
    def end_id(self) -> int:
        return SPECIAL_TOKENS.index("<|end|>")

    def token_id(self, tok: str) -> int:
        """Id of one token string (special or ordinary); KeyError if it is not in the vocab."""
        got = self._hf.token_to_id(tok)
        if got is None:
            raise KeyError(f"token {tok!r} is not in the vocabulary")
        return got

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; special tokens written in the text become their ids."""
        return list(self._hf.encode(text, add_special_tokens=False).ids)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """``encode`` over many texts at once (parallel inside ``tokenizers``)."""
        return [list(e.ids) for e in self._hf.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text of ``ids``; exact inverse of :meth:`encode` unless ``skip_special``."""
        return self._hf.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def to_json(self) -> str:
        """The full tokenizer as HF's tokenizer.json string (stable: used in fingerprints)."""
        return self._hf.to_str()

    @classmethod
    def from_json(cls, text: str) -> "Tokenizer":
        return cls(HFTokenizer.from_str(text))

    def save(self, directory: str | Path) -> Path:
        """Write ``directory/tokenizer.json`` and return its path."""
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        out = path / TOKENIZER_FILE
        out.write_text(self.to_json(), encoding="utf-8")
        return out

    @classmethod
    def load(cls, path: str | Path) -> "Tokenizer":
        """Load from a directory holding tokenizer.json, or from the file itself."""
        p = Path(path)
        if p.is_dir():
            p = p / TOKENIZER_FILE
        if not p.is_file():
            raise FileNotFoundError(f"{p}: no tokenizer.json here")
        return cls.from_json(p.read_text(encoding="utf-8"))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Tokenizer) and json.loads(self.to_json()) == json.loads(other.to_json())

    __hash__ = None  # type: ignore[assignment]  # mutable wrapper; equality is by content

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size})"


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE on ``texts`` with the special tokens at ids 0..8.

    Deterministic for the same texts and vocab size. ``vocab_size`` counts the special tokens
    and the 256 byte symbols, so it must exceed 265.
    """
    floor = len(SPECIAL_TOKENS) + 256
    if vocab_size <= floor:
        raise ValueError(f"vocab_size={vocab_size} must exceed {floor} (special tokens + 256 bytes)")
    hf = HFTokenizer(models.BPE())
    # Words keep their trailing punctuation (`type":"`, `string"},"`), so the JSON around tool
    # schemas costs about one token per key and the merges still generalise to unseen tools.
    # No prefix space: a leading space is real content and must survive the round trip.
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRE_TOKEN_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        # All 256 bytes up front, so text unseen in training still encodes without <unk>.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    hf.train_from_iterator(list(texts), trainer=trainer)
    return Tokenizer(hf)
