"""Extract tool calls from one generated assistant turn, in each template family's form.

Needle's template (docs/architecture.md) makes the model emit

    [<|think|>{reasoning}]<|call|>{compact JSON list of {"name", "arguments"}}<|end|>

``parse_calls(text)`` turns the decoded text of that turn (with or without the trailing
``<|end|>``) into a :class:`ParsedCall`. It never raises: anything malformed (no ``<|call|>``,
broken JSON, a non-list, a call without a string name or an object of arguments, text after
the JSON) gives ``calls=None`` and a one-line ``error`` saying why, so the metrics can count it.

    from needle.data.parse import parse_calls
    parse_calls('<|call|>[{"name":"f","arguments":{"x":1}}]').calls
    # [{'name': 'f', 'arguments': {'x': 1}}]

Pretrained models' templates have their own forms, parsed below to the same ParsedCall: Qwen/Hermes
``<tool_call>{json}</tool_call>``, Llama 3.x JSON calls, FunctionGemma's
``<start_function_call>call:name{…}<end_function_call>``; ``parser_for(template)`` picks one.
Needle 3's ``<tool_call>[…]</tool_call>`` is ``parse_needle3``, ``parser_for("needle3")``: its format
lives in needle/data/needle3_format.py. Parsing sits in data/, beside the formats that render what
it reads back: the formats (render, chat, needle3_format) and evaluation and serving above them all
import it, and it imports only the tokenizers' markers.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from needle.tokenizers.base import CALL, END, THINK
from needle.tokenizers.markers import IM_END, MARKERS, THINK_END, THINK_START, TOOL_CALL_END, TOOL_CALL_START

CALL_KEYS = frozenset({"name", "arguments"})


@dataclass(frozen=True)
class ParsedCall:
    """The outcome of parsing one turn: ``calls`` (None when malformed) and why not."""

    calls: list[dict[str, Any]] | None
    error: str | None
    reasoning: str | None

    @property
    def ok(self) -> bool:
        return self.calls is not None


def _check_call(index: int, call: Any) -> str | None:
    """Return why ``call`` is not a ``{"name": str, "arguments": dict}`` object, or None."""
    if not isinstance(call, dict):
        return f"call {index} is a {type(call).__name__}, not an object"
    extra = set(call) - CALL_KEYS
    if extra:
        return f"call {index} has unexpected keys {sorted(extra)}"
    if not isinstance(call.get("name"), str) or not call["name"]:
        return f"call {index} has no string 'name'"
    if "arguments" not in call:
        return f"call {index} ({call['name']}) has no 'arguments'"
    if not isinstance(call["arguments"], dict):
        return f"call {index} ({call['name']}) 'arguments' is a {type(call['arguments']).__name__}, not an object"
    return None


def check_calls(value: Any) -> str | None:
    """Why ``value`` is not a list of ``{"name": str, "arguments": dict}`` calls, or None."""
    if not isinstance(value, list):
        return f"call JSON is a {type(value).__name__}, not a list"
    for i, call in enumerate(value):
        problem = _check_call(i, call)
        if problem:
            return problem
    return None


def _split_reasoning(text: str) -> tuple[str | None, str, str | None]:
    """Split off ``<|think|>…`` before ``<|call|>``: (reasoning, rest, error)."""
    if not text.startswith(THINK):
        return None, text, None
    body = text[len(THINK) :]
    cut = body.find(CALL)
    if cut < 0:
        # Reasoning that never reached a call: keep it for the report, it is still an error.
        return body.strip(), "", f"no {CALL} after the reasoning"
    return body[:cut].strip(), body[cut:], None


def parse_calls(text: str) -> ParsedCall:
    """Parse the generated assistant turn ``text`` into tool calls; never raises."""
    if not isinstance(text, str):
        return ParsedCall(None, f"expected text, got {type(text).__name__}", None)
    body = text.strip()
    if body.endswith(END):
        body = body[: -len(END)].rstrip()
    reasoning, body, error = _split_reasoning(body)
    if error:
        return ParsedCall(None, error, reasoning)
    if not body.startswith(CALL):
        where = "missing" if CALL not in body else "preceded by other text"
        return ParsedCall(None, f"{CALL} {where}", reasoning)
    payload = body[len(CALL) :]
    if CALL in payload or THINK in payload or END in payload:
        return ParsedCall(None, "special token inside the call JSON", reasoning)
    payload = payload.strip()
    if not payload:
        return ParsedCall(None, f"nothing after {CALL}", reasoning)
    return _decode_call_list(payload, reasoning)


def _decode_call_list(payload: str, reasoning: str | None) -> ParsedCall:
    """One JSON call list filling ``payload`` exactly, checked call by call."""
    try:
        value, end = json.JSONDecoder().raw_decode(payload)
    except json.JSONDecodeError as exc:
        return ParsedCall(None, f"invalid JSON: {exc.msg} at char {exc.pos}", reasoning)
    if payload[end:].strip():
        return ParsedCall(None, f"text after the JSON at char {end}", reasoning)
    problem = check_calls(value)
    return ParsedCall(None, problem, reasoning) if problem else ParsedCall(value, None, reasoning)


# --- pretrained models' forms --------------------------------------------------------------
Parser = Callable[[str], ParsedCall]
_THINK_BLOCK = re.compile(r"\s*<think>(.*?)</think>\s*", re.S)
_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
_FG_CALL = re.compile(r"<start_function_call>call:([^{<\s]+)(.*?)<end_function_call>", re.S)
_FG_ESCAPE = "<escape>"
_FG_SCALAR = re.compile(r"[^,}\]]*")


def _strip_think(text: str) -> tuple[str | None, str]:
    """Split a leading ``<think>…</think>`` (Qwen3 writes one, often empty) from the answer."""
    m = _THINK_BLOCK.match(text)
    if not m:
        return None, text
    return (m.group(1).strip() or None), text[m.end() :]


strip_think = _strip_think  # the public name (needle/eval/reply.py reads text answers with it)


def _as_call(index: int, obj: Any) -> tuple[dict[str, Any] | None, str | None]:
    """``{"name", "arguments"|"parameters"}`` (arguments may be a JSON string) as a needle call."""
    if not isinstance(obj, dict):
        return None, f"call {index} is a {type(obj).__name__}, not an object"
    key = "arguments" if "arguments" in obj else "parameters"
    args = obj.get(key)
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            pass  # left a string: _check_call names the problem
    call = {"name": obj.get("name"), "arguments": args} if key in obj else {"name": obj.get("name")}
    extra = set(obj) - {"name", key}
    problem = f"call {index} has unexpected keys {sorted(extra)}" if extra else _check_call(index, call)
    return (None, problem) if problem else (call, None)


def _collect(objs: list[Any], reasoning: str | None) -> ParsedCall:
    calls = []
    for i, obj in enumerate(objs):
        call, problem = _as_call(i, obj)
        if problem:
            return ParsedCall(None, problem, reasoning)
        calls.append(call)
    return ParsedCall(calls, None, reasoning)


def parse_hermes(text: str) -> ParsedCall:
    """Qwen/Hermes: one ``<tool_call>{"name", "arguments"}</tool_call>`` per call; none = []."""
    reasoning, body = _strip_think(text)
    blocks = _HERMES_BLOCK.findall(body)
    if body.count("<tool_call>") != len(blocks) or body.count("</tool_call>") != len(blocks):
        return ParsedCall(None, "unbalanced <tool_call> tags", reasoning)
    objs = []
    for i, block in enumerate(blocks):
        try:
            objs.append(json.loads(block))
        except json.JSONDecodeError as exc:
            return ParsedCall(None, f"call {i}: invalid JSON: {exc.msg} at char {exc.pos}", reasoning)
    return _collect(objs, reasoning)


def _json_values(text: str) -> list[Any]:
    """Consecutive JSON values separated by whitespace or ``;`` (lists are flattened)."""
    values: list[Any] = []
    decoder, pos = json.JSONDecoder(), 0
    while pos < len(text):
        value, pos = decoder.raw_decode(text, pos)
        values.extend(value if isinstance(value, list) else [value])
        while pos < len(text) and (text[pos].isspace() or text[pos] == ";"):
            pos += 1
    return values


def parse_llama_json(text: str) -> ParsedCall:
    """Llama 3.x: ``{"name", "parameters"}`` objects (one per line, or a list), an optional
    ``<|python_tag|>`` prefix; a plain-text answer means no call ([])."""
    reasoning, body = _strip_think(text)
    body = body.strip().removeprefix("<|python_tag|>").strip()
    for end in ("<|eom_id|>", "<|eot_id|>"):
        body = body.removesuffix(end).rstrip()
    if not body or body[0] not in "{[":
        return ParsedCall([], None, reasoning)
    try:
        objs = _json_values(body)
    except json.JSONDecodeError as exc:
        return ParsedCall(None, f"invalid JSON: {exc.msg} at char {exc.pos}", reasoning)
    return _collect(objs, reasoning)


def _fg_value(s: str, i: int) -> tuple[Any, int]:
    """One FunctionGemma value at ``s[i]``: <escape>str<escape>, {k:v,…}, […], or a scalar."""
    if s.startswith(_FG_ESCAPE, i):
        end = s.index(_FG_ESCAPE, i + len(_FG_ESCAPE))
        return s[i + len(_FG_ESCAPE) : end], end + len(_FG_ESCAPE)
    if s[i] in "{[":
        close, items, obj = ("}" if s[i] == "{" else "]"), [], s[i] == "{"
        i += 1
        while s[i] != close:
            key = None
            if obj:
                colon = s.index(":", i)
                key, i = s[i:colon].strip(), colon + 1
            value, i = _fg_value(s, i)
            items.append((key, value))
            i += 1 if s[i] == "," else 0
        return (dict(items) if obj else [v for _, v in items]), i + 1
    raw = _FG_SCALAR.match(s, i).group(0)  # type: ignore[union-attr]
    try:
        return json.loads(raw), i + len(raw)
    except json.JSONDecodeError:
        return raw.strip(), i + len(raw)


def parse_function_gemma(text: str) -> ParsedCall:
    """FunctionGemma: ``<start_function_call>call:name{key:<escape>v<escape>,…}<end_function_call>``."""
    reasoning, body = _strip_think(text)
    matches = _FG_CALL.findall(body)
    if body.count("<start_function_call>") != len(matches):
        return ParsedCall(None, "unbalanced <start_function_call> tags", reasoning)
    objs = []
    for i, (name, args) in enumerate(matches):
        try:
            value, end = _fg_value(args.strip(), 0)
        except (ValueError, IndexError):
            return ParsedCall(None, f"call {i} ({name}): malformed arguments", reasoning)
        if args.strip()[end:].strip():
            return ParsedCall(None, f"call {i} ({name}): text after the arguments", reasoning)
        objs.append({"name": name, "arguments": value})
    return _collect(objs, reasoning)


def parse_json_list(text: str) -> ParsedCall:
    """A bare JSON list of ``{"name", "arguments"}`` (templates without tool support, see
    needle/data/chat.py); a ```json fence around it is tolerated."""
    reasoning, body = _strip_think(text)
    body = body.strip().removeprefix("```json").removeprefix("```").removesuffix("```").strip()
    if not body:
        return ParsedCall(None, "no call list", reasoning)
    return _decode_call_list(body, reasoning)


def parse_needle3(text: str) -> ParsedCall:
    """Needle 3's ``[<think>\\n…\\n</think>\\n]<tool_call>[…]</tool_call>[<|im_end|>]`` into calls; never raises.

    Strict like ``parse_calls``: a missing or unclosed ``<tool_call>``, text around it, a marker
    inside the JSON, broken JSON or a call that is not ``{"name": str, "arguments": {…}}`` give
    ``calls=None`` and the reason. ``<tool_call>[]</tool_call>`` is the off-topic answer ([]).
    """
    if not isinstance(text, str):
        return ParsedCall(None, f"expected text, got {type(text).__name__}", None)
    body = text.strip()
    if body.endswith(IM_END):
        body = body[: -len(IM_END)].rstrip()
    reasoning = None
    if body.startswith(THINK_START):
        cut = body.find(THINK_END)
        if cut < 0:
            return ParsedCall(None, f"no {THINK_END} after the reasoning", body[len(THINK_START) :].strip() or None)
        reasoning = body[len(THINK_START) : cut].strip() or None
        body = body[cut + len(THINK_END) :].lstrip()
    if not body.startswith(TOOL_CALL_START):
        where = "missing" if TOOL_CALL_START not in body else "preceded by other text"
        return ParsedCall(None, f"{TOOL_CALL_START} {where}", reasoning)
    payload = body[len(TOOL_CALL_START) :]
    end = payload.find(TOOL_CALL_END)
    if end < 0:
        return ParsedCall(None, f"no {TOOL_CALL_END} after the call list", reasoning)
    if payload[end + len(TOOL_CALL_END) :].strip():
        return ParsedCall(None, f"text after {TOOL_CALL_END}", reasoning)
    payload = payload[:end]
    if any(m in payload for m in MARKERS):
        return ParsedCall(None, "special token inside the call JSON", reasoning)
    payload = payload.strip()
    if not payload:
        return ParsedCall(None, f"nothing inside {TOOL_CALL_START}", reasoning)
    try:
        value, stop = json.JSONDecoder().raw_decode(payload)
    except json.JSONDecodeError as exc:
        return ParsedCall(None, f"invalid JSON: {exc.msg} at char {exc.pos}", reasoning)
    if payload[stop:].strip():
        return ParsedCall(None, f"text after the JSON at char {stop}", reasoning)
    problem = check_calls(value)
    return ParsedCall(None, problem, reasoning) if problem else ParsedCall(value, None, reasoning)


def parser_for(template: str | None) -> Parser:
    """The parser for the calls a chat template writes (detected from its text).

    ``"needle3"`` (or a ``Needle3Format.template_id()``) is Needle 3's own row format:
    ``parse_needle3``.
    """
    if template is not None and (template == "needle3" or template.startswith("needle3:")):
        return parse_needle3
    if template is None:
        return parse_calls
    if "<tool_call>" in template:
        return parse_hermes
    if "<start_function_call>" in template:
        return parse_function_gemma
    if '"parameters"' in template or "<|python_tag|>" in template:
        return parse_llama_json
    return parse_json_list
