"""Needle 3's SentencePiece tokenizer behind needle's tokenizer interface.

Needle 3 (cactus-needle 3.x) ships a SentencePiece BPE model, ``tokenizer.model``, whose
special ids are fixed: pad 0, eos 1, bos 2, unk 3 (control pieces, never produced from text),
then the chat markers as user-defined pieces from id 4 (``<|im_start|>`` 4, ``<|im_end|>`` 5,
``<think>`` 6 … ``<tool_result>``/``</tool_result>`` 12/13, and the rest of ``MARKERS``). The
marker text inside any string encodes to its id, exactly as the reference's
``SANTokenizer.encode`` (``sentencepiece`` itself does the encoding, on the model's own
normaliser and settings, so ids are the reference's by construction).

    tok = Needle3Tokenizer.load("snapshot/tokenizer")   # a directory with tokenizer.model, or the file
    tok.save("out/")                                    # writes out/tokenizer.model (bytes as loaded; no pickle)
    load_tokenizer("out/")                              # -> Needle3Tokenizer again
    tok.stop_ids                                        # (<|im_end|> 5, eos 1)

Text is encoded without BOS/EOS: Needle's row format (needle/data/needle3_format.py) adds BOS
in front of the prompt and EOS after the target, as the reference's ``_encode`` does.
``llguidance_tokenizer`` gives the grammar library (needle/eval/constrain.py) each id's bytes:
byte pieces ``<0xNN>`` as that byte, ``▁`` as a space, control pieces and the ``<…>`` markers as
special tokens.

Ported in part from cactus-needle 3.2.8 (needle/model/tokenizer.py), Apache-2.0.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import sentencepiece as spm

# The ids and markers live one layer down, shared with the row format and the parser.
from needle.tokenizers.base import SP_MODEL_FILE, TOKENIZER_FILE
from needle.tokenizers.markers import (
    BOS_ID, EOS_ID, FIRST_MARKER_ID, IM_END_ID, MARKERS, N_FIXED_MARKERS, PAD_ID, UNK_ID,
)  # fmt: skip

META_SPACE = "\u2581"  # SentencePiece's ▁: a space inside a piece


USER_DEFINED = 4  # sentencepiece's ModelProto.SentencePiece.Type.USER_DEFINED (no Python accessor)


def _model_proto(model_bytes: bytes) -> Any:
    from sentencepiece import sentencepiece_model_pb2 as pb  # needs protobuf, as sentencepiece's own tools

    proto = pb.ModelProto()
    proto.ParseFromString(model_bytes)
    return proto


def sp_problem(sp: spm.SentencePieceProcessor, types: list[int]) -> str | None:
    """Why ``sp`` (piece ``types`` from its proto) is not a Needle 3 tokenizer, or None."""
    n = sp.GetPieceSize()
    for name, want, got in (("pad", PAD_ID, sp.pad_id()), ("eos", EOS_ID, sp.eos_id()),
                            ("bos", BOS_ID, sp.bos_id()), ("unk", UNK_ID, sp.unk_id())):  # fmt: skip
        if got != want:
            return f"{name} id is {got}, Needle 3 expects {want}"
    if n < FIRST_MARKER_ID + N_FIXED_MARKERS:
        return f"only {n} pieces: Needle 3's chat markers need ids up to {FIRST_MARKER_ID + N_FIXED_MARKERS - 1}"
    for i, marker in enumerate(MARKERS):
        tid = FIRST_MARKER_ID + i
        present = sp.PieceToId(marker) != sp.unk_id()
        if i >= N_FIXED_MARKERS and not present:
            continue
        if sp.PieceToId(marker) != tid or types[tid] != USER_DEFINED:
            return f"chat marker {marker} is not the user-defined piece {tid}"
    return None


class Needle3Tokenizer:
    """A Needle 3 ``tokenizer.model`` (SentencePiece) as a :class:`needle.tokenizers.base.TokenizerLike`."""

    def __init__(self, model_bytes: bytes) -> None:
        self._bytes = bytes(model_bytes)
        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.LoadFromSerializedProto(self._bytes)
        except (RuntimeError, OSError) as exc:
            raise ValueError(f"not a SentencePiece model: {exc}") from None
        proto = _model_proto(self._bytes)
        self._types = [int(p.type) for p in proto.pieces]
        self._add_dummy_prefix = bool(proto.normalizer_spec.add_dummy_prefix)
        problem = sp_problem(self._sp, self._types)
        if problem:
            raise ValueError(f"not a Needle 3 tokenizer: {problem}")
        self._n = self._sp.GetPieceSize()
        self._special = frozenset(i for i in range(self._n) if self._is_special(i))

    def _is_special(self, i: int) -> bool:
        sp = self._sp
        if sp.IsControl(i) or sp.IsUnknown(i):
            return True
        piece = sp.IdToPiece(i)
        return bool(self._types[i] == USER_DEFINED and piece.startswith("<") and piece.endswith(">"))

    # -- ids ----------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self._n

    @property
    def pad_id(self) -> int:
        return PAD_ID

    @property
    def bos_id(self) -> int:
        return BOS_ID

    @property
    def eos_id(self) -> int:
        return EOS_ID

    @property
    def unk_id(self) -> int:
        return UNK_ID

    @property
    def end_id(self) -> int:
        """``<|im_end|>``: the last token of Needle's assistant turn (EOS follows it in training)."""
        return IM_END_ID

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Ids that end generation: ``<|im_end|>``, then eos (where the reference stops)."""
        return (IM_END_ID, EOS_ID)

    @property
    def special_ids(self) -> frozenset[int]:
        """Control pieces (pad, eos, bos), unk and the ``<…>`` chat markers."""
        return self._special

    @property
    def chat_template(self) -> str | None:
        """None: Needle's row format is needle/data/needle3_format.py, not a Jinja template."""
        return None

    @property
    def add_dummy_prefix(self) -> bool:
        return self._add_dummy_prefix

    def token_id(self, tok: str) -> int:
        """Id of one piece (``"<|im_end|>"``, ``"▁the"``, ``"</s>"``); KeyError when absent."""
        tid = self._sp.PieceToId(tok)
        if tid == UNK_ID and tok != self._sp.IdToPiece(UNK_ID):
            raise KeyError(f"token {tok!r} is not in the vocabulary")
        return int(tid)

    def piece(self, tid: int) -> str:
        return self._sp.IdToPiece(int(tid))

    # -- text -----------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Ids of ``text`` as the reference's ``SANTokenizer.encode`` (markers become their ids)."""
        return list(self._sp.Encode(text, out_type=int))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(ids) for ids in self._sp.Encode(list(texts), out_type=int)]

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text of ``ids`` as the reference's ``decode`` (control ids write nothing; ids past the
        vocabulary, a padded model head's, are dropped); ``skip_special`` also drops unk and the
        chat markers."""
        keep = [int(i) for i in ids if 0 <= int(i) < self._n]
        if skip_special:
            keep = [i for i in keep if i not in self._special]
        return self._sp.Decode(keep)

    # -- persistence ---------------------------------------------------------------------------
    @property
    def model_bytes(self) -> bytes:
        return self._bytes

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self._bytes).hexdigest()

    def to_json(self) -> str:
        """A stable JSON identity for fingerprints: the model file's sha256 (the model is binary)."""
        return json.dumps({"type": "sentencepiece", "format": "needle3", "file": SP_MODEL_FILE,
                           "sha256": self.sha256, "vocab_size": self._n}, sort_keys=True)  # fmt: skip

    def save(self, directory: str | Path) -> Path:
        """Write ``directory/tokenizer.model`` (the bytes as loaded) and return its path."""
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        out = path / SP_MODEL_FILE
        out.write_bytes(self._bytes)
        return out

    @classmethod
    def load(cls, path: str | Path) -> "Needle3Tokenizer":
        """From a directory holding ``tokenizer.model`` (or ``tokenizer/tokenizer.model``), or the file."""
        p = Path(path)
        if p.is_dir():
            p = p / SP_MODEL_FILE if (p / SP_MODEL_FILE).is_file() else p / "tokenizer" / SP_MODEL_FILE
        if not p.is_file():
            raise FileNotFoundError(f"{p}: no {SP_MODEL_FILE} here")
        try:
            return cls(p.read_bytes())
        except ValueError as exc:
            raise ValueError(f"{p}: {exc}") from None

    # -- grammar support ---------------------------------------------------------------------
    def token_bytes(self) -> list[bytes]:
        """Each id's bytes as the grammar sees them; special ids are ``b"\\xff" + piece``."""
        out: list[bytes] = []
        for i in range(self._n):
            piece = self._sp.IdToPiece(i)
            if i in self._special:
                out.append(b"\xff" + piece.encode("utf-8"))
            elif self._sp.IsByte(i):
                out.append(bytes([int(piece[3:5], 16)]))
            else:
                out.append(piece.replace(META_SPACE, " ").encode("utf-8"))
        return out

    def _no_dummy_processor(self) -> spm.SentencePieceProcessor:
        # Grammar tokenization continues text already started: no dummy "▁" in front.
        proto = _model_proto(self._bytes)
        proto.normalizer_spec.add_dummy_prefix = False
        sp = spm.SentencePieceProcessor()
        sp.LoadFromSerializedProto(proto.SerializeToString())
        return sp

    def llguidance_tokenizer(self, eos_ids: Iterable[int] | None = None, n_vocab: int | None = None) -> Any:
        """An ``llguidance.LLTokenizer`` over this vocabulary (token bytes as :meth:`token_bytes`)."""
        import llguidance

        stops = [int(i) for i in (eos_ids if eos_ids is not None else self.stop_ids)]
        wrapper = llguidance.TokenizerWrapper(_GrammarVocab(self.token_bytes(), self._no_dummy_processor(), stops[0],
                                                            sorted(self._special)))  # fmt: skip
        return llguidance.LLTokenizer(wrapper, n_vocab=n_vocab or self._n, eos_token=stops)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Needle3Tokenizer) and self._bytes == other._bytes

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Needle3Tokenizer(vocab_size={self._n}, sha256={self.sha256[:12]})"


class _GrammarVocab:
    """What ``llguidance.TokenizerWrapper`` reads: token bytes, eos/bos, special ids, a tokenizer."""

    def __init__(self, tokens: list[bytes], sp: spm.SentencePieceProcessor, eos: int, special: list[int]) -> None:
        self.tokens = tokens
        self.eos_token_id = eos
        self.bos_token_id = BOS_ID
        self.special_token_ids = special
        self._sp = sp

    def __call__(self, text: str) -> list[int]:
        if isinstance(text, bytes):
            raise TypeError("text only")  # TokenizerWrapper then passes str
        return list(self._sp.Encode(text, out_type=int))


def is_needle3_tokenizer_dir(path: str | Path) -> bool:
    """True for a directory with ``tokenizer.model`` and no ``tokenizer.json``, or a ``.model`` file."""
    p = Path(path)
    if p.is_file():
        return p.name.endswith(".model")
    return p.is_dir() and (p / SP_MODEL_FILE).is_file() and not (p / TOKENIZER_FILE).is_file()
