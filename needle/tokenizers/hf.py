"""A pretrained Hugging Face model's tokenizer, behind needle's tokenizer interface.

Reads what ``transformers``' ``save_pretrained`` writes, without importing transformers:
``tokenizer.json`` (HF ``tokenizers``), ``tokenizer_config.json`` (bos/eos/pad tokens, the chat
template in older layouts), ``chat_template.jinja`` (where transformers 5 writes the template)
and, when present, ``generation_config.json`` (its ``eos_token_id`` adds stop ids).

    tok = HFTokenizer.load("models/qwen3")        # or needle.tokenizers.load.load_tokenizer(dir)
    tok.stop_ids        # e.g. (<|im_end|>, <|endoftext|>) for Qwen3
    tok.save("out/")    # tokenizer.json, tokenizer_config.json, chat_template.jinja

Text is always encoded with ``add_special_tokens=False``: a chat template writes its own
``bos_token``, so the post-processor must not add a second one.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as RawTokenizer

from needle.tokenizers.base import TOKENIZER_FILE, RawTokenIds

CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
GENERATION_FILE = "generation_config.json"
# transformers' named special tokens: exactly these reach a chat template as variables.
SPECIAL_ATTRIBUTES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# Tokens that end an assistant turn in the common families (Qwen/ChatML, Llama 3.x, Gemma, Phi).
# The first one the chat template writes is the turn end; without one, eos ends the turn.
TURN_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", "<|eot|>", "<|end_of_turn|>")


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json stores it: a string or an AddedToken object."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _pick_template(value: Any) -> str | None:
    """The template used with tools: a plain string, or ``tool_use``/``default`` of named ones."""
    if isinstance(value, list):  # older configs: [{"name": ..., "template": ...}]
        value = {t["name"]: t["template"] for t in value}
    if isinstance(value, dict):
        return value.get("tool_use") or value.get("default")
    return value if isinstance(value, str) else None


class HFTokenizer(RawTokenIds):
    """A model's own tokenizer: ``tokenizers`` for the ids, its config for specials and template."""

    def __init__(
        self,
        raw: RawTokenizer,
        config: dict[str, Any] | None = None,
        chat_template: str | None = None,
        generation_eos: Iterable[int] = (),
        tokenizer_json: str | None = None,
    ) -> None:
        self._raw = raw
        self._config = {k: v for k, v in (config or {}).items() if k != "chat_template"}
        in_config = _pick_template((config or {}).get("chat_template"))
        self._template = chat_template if chat_template is not None else in_config
        self._generation_eos = tuple(int(i) for i in generation_eos)
        # Keep the file's own text: to_json() feeds fingerprints and must not change on a round trip.
        self._json = tokenizer_json if tokenizer_json is not None else raw.to_str()
        if self.eos_id is None and not self._generation_eos:
            raise ValueError("tokenizer has no eos_token (tokenizer_config.json) and no eos_token_id "
                             "(generation_config.json): generation could never stop")  # fmt: skip

    # -- special tokens -------------------------------------------------------------------
    def special_token(self, attr: str) -> str | None:
        """The text of a named special token (``"eos_token"``…), None when unset."""
        return _token_text(self._config.get(attr))

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """The named special tokens, as transformers passes them to a chat template."""
        return {a: t for a in SPECIAL_ATTRIBUTES if (t := self.special_token(a)) is not None}

    def _id_of(self, attr: str) -> int | None:
        text = self.special_token(attr)
        return self._raw.token_to_id(text) if text is not None else None

    @property
    def bos_id(self) -> int | None:
        return self._id_of("bos_token")

    @property
    def eos_id(self) -> int | None:
        got = self._id_of("eos_token")
        return got if got is not None else (self._generation_eos[0] if self._generation_eos else None)

    @property
    def pad_id(self) -> int:
        """pad_token's id, else eos: padded positions are masked, any valid id serves."""
        got = self._id_of("pad_token")
        return got if got is not None else int(self.eos_id)  # type: ignore[arg-type]

    @property
    def end_id(self) -> int:
        """The id that ends an assistant turn: the template's turn-end token, else eos."""
        template = self._template or ""
        for text in TURN_END_TOKENS:
            got = self._raw.token_to_id(text)
            if got is not None and text in template:
                return got
        return int(self.eos_id)  # type: ignore[arg-type]

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Ids that end generation: the turn end, eos, and generation_config's eos ids."""
        ids = [self.end_id, self.eos_id, *self._generation_eos]
        return tuple(dict.fromkeys(int(i) for i in ids if i is not None))

    @property
    def add_bos_token(self) -> bool:
        return bool(self._config.get("add_bos_token", False))

    @property
    def chat_template(self) -> str | None:
        return self._template

    # -- persistence (ids and text: RawTokenIds) -------------------------------------------- -----------------------------------------------------------------------
    def to_json(self) -> str:
        """tokenizer.json's text as loaded (the chat template is hashed by the ChatFormat)."""
        return self._json

    def save(self, directory: str | Path) -> Path:
        """Write tokenizer.json, tokenizer_config.json, chat_template.jinja (and the generation eos ids)."""
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        out = path / TOKENIZER_FILE
        out.write_text(self._json, encoding="utf-8")
        (path / CONFIG_FILE).write_text(json.dumps(self._config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        if self._template is not None:
            (path / TEMPLATE_FILE).write_text(self._template, encoding="utf-8")
        gen = path / GENERATION_FILE
        if self._generation_eos and not gen.exists():
            # The extra stop ids (Qwen's <|endoftext|>) live there; a saved model must keep them.
            gen.write_text(json.dumps({"eos_token_id": list(self._generation_eos)}, indent=2) + "\n", encoding="utf-8")
        return out

    @classmethod
    def load(cls, path: str | Path) -> "HFTokenizer":
        """Read a Hugging Face tokenizer directory (or its tokenizer.json's path)."""
        root = Path(path)
        if root.is_file():
            root = root.parent
        file = root / TOKENIZER_FILE
        if not file.is_file():
            raise FileNotFoundError(f"{file}: no tokenizer.json here")
        text = file.read_text(encoding="utf-8")
        config = _read_json(root / CONFIG_FILE)
        template_file = root / TEMPLATE_FILE
        # As in transformers: chat_template.jinja, when present, wins over the config's template.
        template = template_file.read_text(encoding="utf-8") if template_file.is_file() else None
        eos = _read_json(root / GENERATION_FILE).get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        return cls(RawTokenizer.from_str(text), config, template, eos_ids, tokenizer_json=text)

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, HFTokenizer) and self._json == other._json and self._config == other._config
                and self._template == other._template)  # fmt: skip

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"HFTokenizer(vocab_size={self.vocab_size}, stop_ids={self.stop_ids})"


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object file, or {} when absent; a broken file is an error naming it."""
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}:{exc.lineno}: invalid JSON: {exc.msg}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return value
