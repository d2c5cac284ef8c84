"""Schema-constrained tool calls: the offered tools' JSON schemas as a grammar, and per-row token masks.

While decoding (needle/eval/decode.py, ``constraints=…``) every step's logits are masked so the
model can only write, in its own chat format, a call list that parses, names only the tools the
request offered and whose arguments satisfy each tool's JSON schema (required keys, types,
enums; argument names the schema does not declare are refused unless it sets
``additionalProperties`` itself, as needle/eval/metrics.py scores them), or the empty list.

The grammar library is `llguidance <https://github.com/guidance-ai/llguidance>`_ (chosen by
measured speed on this machine, see bench/serve.py ``--libs``): it reads the model's own
``tokenizer.json`` (needle's BPE or a Hugging Face model's) without transformers or torch, takes a
Lark grammar with embedded JSON schemas (``%json {…}``) and special tokens (``<|call|>``), and
fills a numpy bitmask of allowed tokens for a whole batch in parallel.

Per chat format (needle/data/chat.py ``format_for``), what a call list is:

- needle's template: ``<|call|>`` then the compact JSON list ``[{"name":…,"arguments":{…}}]``;
- templates without tool calls (Gemma 3…): that JSON list alone;
- Qwen/Hermes: ``<tool_call>\\n{"name": …, "arguments": {…}}\\n</tool_call>`` blocks, none for [];
- Llama 3.x: one ``{"name": …, "parameters": {…}}`` object, or nothing for [];
- Needle 3's own format (needle/data/needle3_format.py): an optional space (SentencePiece's
  dummy prefix), ``<tool_call>``, the compact JSON list, ``</tool_call>``, then ``<|im_end|>``
  (a stop id), over its SentencePiece vocabulary (the tokenizer's ``llguidance_tokenizer()``:
  byte pieces as bytes, ``▁`` as a space, the chat markers special); the optional ``<think>``
  block is not offered: constrained rows answer directly;
- FunctionGemma's ``call:name{…}`` is not JSON: ``Constraints.supported`` is False there and
  decoding stays free (``grammar_for`` raises :class:`UnsupportedFormat`).

What a row may answer is its ``mode`` (:data:`MODES`): ``calls`` a call list (``[]`` included;
what evaluation and the table shape ask), ``required`` at least one call, ``none`` plain text,
``auto`` either (OpenAI's ``tool_choice``). Plain text (``TEXT``) is at least one
non-space character, holds none of the format's call markers (a special token never matches
it; a marker that is plain text is excluded by the regex) and, for the JSON formats, does not
start with ``[`` or ``{``; so a row's answer reads back unambiguously as calls or as text
(needle/eval/reply.py).

The end of the call list is the tokenizer's stop ids (``tok.stop_ids``): once the grammar is
complete only they are allowed. Grammars are compiled once per tool set and mode (an LRU cache
keyed by the tools' canonical JSON); each row gets a cheap copy of the compiled matcher.

    cons = Constraints.for_tokenizer(tok, fmt)
    matcher = cons.matcher(row.tools)          # raises ToolSchemaError for a bad schema
    matcher = cons.matcher(row.tools, "auto")  # calls or plain text
"""

from __future__ import annotations

import copy
import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from needle.data import parse
from needle.data.render import NativeFormat
from needle.tokenizers.base import CALL, TokenizerLike

LIBRARY = "llguidance"
# A constrained row with this many tokens of budget left is steered to finish its call list:
# among the tokens the grammar allows it picks those that close strings, objects and the list
# (and a stop id as soon as one is allowed), so a call list is complete before the budget ends.
# Only a row that has opened a call list is steered (Constraints.opens_call_list): an answer in
# words, or a reply that has not begun one, is the same whatever its budget.
CLOSE_RESERVE = 24
CACHE_SIZE = 256


class ToolSchemaError(ValueError):
    """The offered tools cannot be turned into a grammar (a schema that is not an object, …)."""


class UnsupportedFormat(ValueError):
    """The chat format writes calls in a form this module has no grammar for."""


def arguments_schema(tool: dict[str, Any]) -> dict[str, Any]:
    """The tool's ``parameters`` schema, closed to undeclared argument names unless it says otherwise."""
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise ToolSchemaError("a tool has no string 'name'")
    params = tool.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict) or params.get("type", "object") != "object":
        raise ToolSchemaError(f"tool '{name}': 'parameters' must be a JSON schema of \"type\": \"object\"")
    schema = copy.deepcopy(params)
    schema["type"] = "object"
    schema.setdefault("properties", {})
    schema.setdefault("additionalProperties", False)
    return schema


def call_schema(tool: dict[str, Any], args_key: str = "arguments") -> dict[str, Any]:
    """One call of ``tool``: ``{"name": <its name>, args_key: <its arguments>}``, both required."""
    return {
        "type": "object",
        "properties": {"name": {"const": tool["name"]}, args_key: arguments_schema(tool)},
        "required": ["name", args_key],
        "additionalProperties": False,
    }


def any_call_schema(tools: Sequence[dict[str, Any]], args_key: str = "arguments") -> dict[str, Any]:
    """A call of any one of ``tools`` (nothing matches when there are none)."""
    if not isinstance(tools, (list, tuple)):
        raise ToolSchemaError(f"tools must be a list, got {type(tools).__name__}")
    calls = [call_schema(t if isinstance(t, dict) else {}, args_key) for t in tools]
    names = [t["name"] for t in tools]
    if len(set(names)) != len(names):
        raise ToolSchemaError(f"tool names must be unique, got {names}")
    return {"anyOf": calls} if calls else {"not": {}}


def call_list_schema(tools: Sequence[dict[str, Any]], min_items: int = 0) -> dict[str, Any]:
    """A JSON list of calls to ``tools`` (``[]`` included unless ``min_items``)."""
    items = any_call_schema(tools)
    if not tools:
        return {"type": "array", "maxItems": 0}
    return {"type": "array", "items": items, **({"minItems": min_items} if min_items else {})}


# JSON spacing per format: needle's compact JSON, and Jinja's tojson (", " and ": ") for HF templates.
COMPACT = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
SPACED = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _json_rule(schema: dict[str, Any], spacing: dict[str, Any]) -> str:
    return "%json " + json.dumps({**schema, "x-guidance": spacing}, ensure_ascii=False)


def _lit(text: str, specials: dict[str, int]) -> str:
    """A Lark terminal: a special token by id (``<[id]>``), or a quoted string."""
    if text in specials:
        return f"<[{specials[text]}]>"
    return json.dumps(text)


def format_kind(fmt: Any) -> str:
    """``native``, ``needle3``, ``json_list``, ``hermes``, ``llama`` or ``function_gemma`` for a ChatFormat."""
    if isinstance(fmt, NativeFormat):
        return "native"
    if getattr(fmt, "name", None) == "needle3":  # Needle3Format (needle/data/needle3_format.py)
        return "needle3"
    parser = getattr(fmt, "_parser", None)
    kinds = {parse.parse_json_list: "json_list", parse.parse_hermes: "hermes",
             parse.parse_llama_json: "llama", parse.parse_function_gemma: "function_gemma",
             parse.parse_calls: "native"}  # fmt: skip
    if parser not in kinds:
        raise UnsupportedFormat(f"no call grammar for {fmt!r}")
    return kinds[parser]


MODES = ("calls", "auto", "required", "none")
# Per format: the call opener a TEXT answer must not contain, and whether TEXT must not start
# like JSON (formats whose calls are bare JSON).
_TEXT_RULES = {"native": (CALL, False), "needle3": ("<tool_call>", False), "hermes": ("<tool_call>", False),
               "llama": (None, True), "json_list": (None, True)}  # fmt: skip
_REGEX_META = set("\\.+*?()|[]{}^$#&-~/")


def _text_rule(kind: str, specials: dict[str, int]) -> str:
    """``TEXT``: a plain-text answer in format ``kind`` (module doc)."""
    marker, json_like = _TEXT_RULES[kind]
    first = "[^\\s\\[{`]" if json_like else "[^\\s]"
    rule = f"TEXT: /\\s*{first}(.|\\n)*/"
    if marker is not None and marker not in specials:
        escaped = "".join("\\" + c if c in _REGEX_META else c for c in marker)
        rule += f" & ~/(.|\\n)*{escaped}(.|\\n)*/"
    return rule + "\n"


def _calls_start(kind: str, tools: Sequence[dict[str, Any]], specials: dict[str, int], required: bool) -> str:
    """The ``calls_start`` rule (and the rules it uses) of a call list in format ``kind``."""
    if kind == "native":
        schema = call_list_schema(tools, int(required))
        return f"calls_start: {_lit(CALL, specials)} calls\ncalls: {_json_rule(schema, COMPACT)}\n"
    if kind == "needle3":
        open_, close = _lit("<tool_call>", specials), _lit("</tool_call>", specials)
        # An optional leading space: with SentencePiece's dummy prefix the target, encoded on its
        # own as the reference does, starts with "▁" (decoding drops it again).
        schema = call_list_schema(tools, int(required))
        return f'calls_start: " "? {open_} calls {close}\ncalls: {_json_rule(schema, COMPACT)}\n'
    if kind == "json_list":
        return f"calls_start: calls\ncalls: {_json_rule(call_list_schema(tools, int(required)), SPACED)}\n"
    if kind == "hermes":
        open_, close = _lit("<tool_call>", specials), _lit("</tool_call>", specials)
        if not tools:
            return "calls_start: think\n"
        blocks = 'block ("\\n" block)*' if required else '(block ("\\n" block)*)?'
        return (
            f"calls_start: think {blocks}\n"
            f'block: {open_} "\\n" call "\\n" {close}\n'
            f"call: {_json_rule(any_call_schema(tools), SPACED)}\n"
        )
    if kind == "llama":
        if not tools:
            return 'calls_start: ""\n'
        call = "call" if required else "call?"
        return f"calls_start: {call}\ncall: {_json_rule(any_call_schema(tools, 'parameters'), SPACED)}\n"
    raise UnsupportedFormat(f"no call grammar for the {kind} call format")


def grammar_for(kind: str, tools: Sequence[dict[str, Any]], specials: dict[str, int] | None = None,
                mode: str = "calls") -> str:  # fmt: skip
    """The Lark grammar (llguidance dialect) of an answer of format ``kind`` for ``tools`` in
    ``mode`` (module doc): ``calls`` the call list, ``required`` a non-empty one, ``none``
    plain text, ``auto`` either (only text when no tool is offered)."""
    specials = specials or {}
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "required" and not tools:
        raise ToolSchemaError("at least one call is required, but no tool is offered")
    if kind not in _TEXT_RULES:
        raise UnsupportedFormat(f"no call grammar for the {kind} call format")
    # Qwen3 writes an (empty) reasoning block first: allowed, but only empty.
    think = f'think: ({_lit("<think>", specials)} "\\n\\n" {_lit("</think>", specials)} "\\n\\n")?\n'
    think = think if kind == "hermes" else ""
    if mode == "none" or (mode == "auto" and not tools):
        return ("start: think TEXT\n" if think else "start: TEXT\n") + think + _text_rule(kind, specials)
    calls = _calls_start(kind, tools, specials, mode == "required")
    if mode == "auto":
        text = "think TEXT" if think else "TEXT"
        return f"start: calls_start | {text}\n{calls}{think}{_text_rule(kind, specials)}"
    return f"start: calls_start\n{calls}{think}"


def _token_id_or_none(tok: TokenizerLike, text: str) -> int | None:
    try:
        return int(tok.token_id(text))
    except KeyError:
        return None


def tools_key(tools: Sequence[dict[str, Any]]) -> str:
    """The cache key of a tool set: its canonical JSON (order of tools and keys kept)."""
    try:
        return json.dumps(tools, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ToolSchemaError(f"tools are not JSON: {exc}") from None


@dataclass
class Constraints:
    """Grammar masks for one tokenizer and chat format; compiled matchers cached per tool set."""

    kind: str
    vocab_size: int
    stop_ids: tuple[int, ...]
    _lltok: Any
    _specials: dict[str, int]

    def __post_init__(self) -> None:
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()
        self.n_compiled = 0

    @classmethod
    def for_tokenizer(cls, tok: TokenizerLike, fmt: Any) -> "Constraints":
        """Constraints for ``tok`` in chat format ``fmt``; UnsupportedFormat for FunctionGemma's."""
        import llguidance

        kind = format_kind(fmt)
        if kind == "function_gemma":
            raise UnsupportedFormat("FunctionGemma's call:name{…} format is not JSON: no call grammar")
        stops = tuple(int(i) for i in tok.stop_ids)
        own = getattr(tok, "llguidance_tokenizer", None)  # a vocabulary that is no tokenizer.json (Needle 3's)
        if own is not None:
            lltok = own(stops)
        else:
            lltok = llguidance.LLTokenizer(tok.to_json(), n_vocab=tok.vocab_size, eos_token=list(stops))
        specials = {}
        for text in (CALL, "<tool_call>", "</tool_call>", "<think>", "</think>"):
            tid = tok._raw.token_to_id(text) if hasattr(tok, "_raw") else _token_id_or_none(tok, text)  # noqa: SLF001
            if tid is not None and lltok.is_special_token(tid):
                specials[text] = int(tid)
        return cls(kind, tok.vocab_size, stops, lltok, specials)

    @property
    def tok_vocab(self) -> int:
        return int(self._lltok.vocab_size)

    def token_bytes(self) -> list[bytes]:
        """Each token id's bytes (cached), for tracking whether a row is inside a JSON string."""
        if getattr(self, "_bytes", None) is None:
            self._bytes = [self._lltok.decode_bytes([i]) for i in range(self.tok_vocab)]
        return self._bytes

    def opens_call_list(self, ids: Sequence[int]) -> bool:
        """Whether a row's output ``ids`` so far has opened a call list: a call opener
        (``<|call|>``, ``<tool_call>``) or, in the JSON formats, a leading ``[``/``{``. Steering
        (``CLOSE_RESERVE``) closes only such a row: an answer in words, or one that has not begun
        a call (an empty reasoning block at most), decodes as it would with any budget."""
        openers = {self._specials.get(t) for t in (CALL, "<tool_call>")} - {None}
        if any(int(i) in openers for i in ids):
            return True
        table = self.token_bytes()
        text = b"".join(table[int(i)] for i in ids if int(i) < len(table)).decode("utf-8", "replace")
        if self.kind in ("native", "needle3", "hermes"):
            return CALL in text or "<tool_call>" in text
        return text.lstrip()[:1] in ("[", "{")

    def close_scores(self, model_vocab: int) -> np.ndarray:
        """``[2, vocab]`` closing scores (see ``CLOSE_RESERVE``): row 0 outside a JSON string, the
        length of a token made only of ``}``/``]``; row 1 inside one, 1 + that for a token that
        is ``"`` followed only by them. Stop ids score 100 in both, other tokens 0."""
        size = max(model_vocab, self.tok_vocab)
        if getattr(self, "_close", None) is None or self._close.shape[1] != size:
            scores = np.zeros((2, size), np.float32)
            for i, raw in enumerate(self.token_bytes()):
                if raw and not raw.strip(b"}]"):
                    scores[0, i] = len(raw)
                if raw.startswith(b'"') and not raw[1:].strip(b"}]"):
                    scores[1, i] = len(raw)
            scores[:, list(self.stop_ids)] = 100.0
            self._close = scores
        return self._close

    def grammar(self, tools: Sequence[dict[str, Any]], mode: str = "calls") -> str:
        return grammar_for(self.kind, tools, self._specials, mode)

    def _compiled(self, tools: Sequence[dict[str, Any]], mode: str) -> Any:
        import llguidance

        key = tools_key(tools) if mode == "calls" else f"{mode}:{tools_key(tools)}"
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        matcher = llguidance.LLMatcher(self._lltok, self.grammar(tools, mode), log_level=0)
        if matcher.is_error():
            raise ToolSchemaError(f"tool schemas not supported by the call grammar: {matcher.get_error()}")
        with self._lock:
            self._cache[key] = matcher
            self.n_compiled += 1
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return matcher

    def matcher(self, tools: Sequence[dict[str, Any]], mode: str = "calls") -> Any:
        """A fresh matcher for one row offered ``tools`` answering in ``mode`` (compiled once per
        tool set and mode)."""
        return self._compiled(tools, mode).deep_copy()


class BatchMasks:
    """Per-row matchers of one decode batch and their bitmask (``[rows, ceil(vocab/32)]`` int32).

    Rows without a matcher (batch padding, free rows) allow every token. ``update(tokens)``
    feeds each live row its chosen token and recomputes the masks in parallel.
    """

    def __init__(self, matchers: Sequence[Any | None], tok_vocab: int, model_vocab: int, stop_ids: Sequence[int]) -> None:
        import llguidance

        self.matchers = list(matchers)
        self.stop = int(stop_ids[0])
        # llguidance fills exactly the tokenizer's words; ids past it (model vocab padding) stay
        # forbidden in constrained rows.
        self._bits = np.full((len(self.matchers), (tok_vocab + 31) // 32), -1, np.int32)
        self.bits = np.full((len(self.matchers), (max(model_vocab, tok_vocab) + 31) // 32), -1, np.int32)
        self._constrained = np.array([m is not None for m in self.matchers])
        self.bits[self._constrained] = 0
        self._exec = llguidance.LLExecutor()
        self._live = [(m, i) for i, m in enumerate(self.matchers) if m is not None]
        self.in_string = np.zeros(len(self.matchers), bool)
        self._escaped = np.zeros(len(self.matchers), bool)
        self._fill()

    def _fill(self) -> None:
        from llguidance.numpy import fill_next_token_bitmask_par

        if not self._live:
            return
        fill_next_token_bitmask_par(self._exec, self._live, self._bits)
        for m, i in self._live:
            if m.is_error() or m.is_stopped():
                # Only a stop id is left (grammar complete), or the matcher failed: end the row.
                self._bits[i] = 0
                self._bits[i, self.stop // 32] = np.uint32(1 << (self.stop % 32)).view(np.int32)
        rows = [i for _, i in self._live]
        self.bits[rows, : self._bits.shape[1]] = self._bits[rows]

    def update(self, tokens: np.ndarray, done: np.ndarray, token_bytes: Sequence[bytes]) -> None:
        """Feed row i its token ``tokens[i]`` (rows already ``done`` are dropped) and refill masks."""
        live = []
        for m, i in self._live:
            if done[i]:
                continue
            m.consume_token(int(tokens[i]))
            self._scan(i, token_bytes[int(tokens[i])])
            live.append((m, i))
        self._live = live
        self._fill()

    def _scan(self, i: int, raw: bytes) -> None:
        # Whether row i is inside a JSON string after ``raw`` (the grammar keeps the JSON valid).
        in_string, escaped = bool(self.in_string[i]), bool(self._escaped[i])
        for byte in raw:
            if escaped:
                escaped = False
            elif in_string and byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:  # quote
                in_string = not in_string
        self.in_string[i], self._escaped[i] = in_string, escaped
