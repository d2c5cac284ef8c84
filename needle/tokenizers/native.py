"""Tokenizers: needle's own byte-level BPE, and a Hugging Face model's tokenizer, one interface.

``Tokenizer`` is needle's tokenizer: a byte-level BPE trained on the data (HF ``tokenizers``),
whose special tokens (``SPECIAL_TOKENS``) always take ids 0..8 in the documented order; every
UTF-8 string encodes without unknown tokens and decodes back byte for byte.
``HFTokenizer`` (needle/tokenizers/hf.py) wraps a pretrained model's ``tokenizer.json`` with its
``tokenizer_config.json`` and chat template. Both satisfy :class:`TokenizerLike`;
``load_tokenizer(dir)`` picks the right one from what is on disk.

    tok = train_tokenizer(texts, vocab_size=1024)
    tok.save("out/")                      # writes out/tokenizer.json (JSON, never pickle)
    tok = load_tokenizer("out/")          # Tokenizer here; HFTokenizer for a HF model directory
    assert tok.decode(tok.encode("héllo 🎉")) == "héllo 🎉"
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Regex
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from needle.tokenizers.base import BOS, END, PAD, SPECIAL_TOKENS, TOKENIZER_FILE, RawTokenIds

# A word with the punctuation that follows it, a single digit, a punctuation run, or whitespace.
# Digits stay single tokens: a small model copies "K33026" or "472.18" from the query into the
# call far more reliably when every number is spelt the same way, digit by digit.
PRE_TOKEN_PATTERN = r" ?\p{L}+[^\s\p{L}\p{N}]*| ?\p{N}| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"


class Tokenizer(RawTokenIds):
    """A thin, typed wrapper over an HF byte-level BPE ``tokenizers.Tokenizer``."""

    def __init__(self, hf: RawTokenizer) -> None:
        self._raw = hf
        self._check_specials()

    def _check_specials(self) -> None:
        # The template and the model code hard-wire pad=0 etc.; a tokenizer with other ids
        # would train silently wrong, so refuse it here.
        problem = native_specials_problem(self._raw)
        if problem:
            raise ValueError(problem)

    @property
    def pad_id(self) -> int:
        return SPECIAL_TOKENS.index(PAD)

    @property
    def bos_id(self) -> int:
        return SPECIAL_TOKENS.index(BOS)

    @property
    def end_id(self) -> int:
        return SPECIAL_TOKENS.index(END)

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Ids that end generation: only ``<|end|>`` for needle's template."""
        return (self.end_id,)

    @property
    def chat_template(self) -> str | None:
        """None: needle's own template (needle/data/render.py) is not a Jinja chat template."""
        return None

    def to_json(self) -> str:
        """The full tokenizer as HF's tokenizer.json string (stable: used in fingerprints)."""
        return self._raw.to_str()

    @classmethod
    def from_json(cls, text: str) -> "Tokenizer":
        return cls(RawTokenizer.from_str(text))

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
    hf = RawTokenizer(models.BPE())
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


def native_specials_problem(raw: RawTokenizer) -> str | None:
    """Why ``raw`` is not a needle tokenizer (special tokens not at ids 0..8), or None."""
    for expected, tok in enumerate(SPECIAL_TOKENS):
        got = raw.token_to_id(tok)
        if got != expected:
            return f"special token {tok} has id {got}, expected {expected}"
    return None
