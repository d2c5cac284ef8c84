"""Extract tool calls from one generated assistant turn.

The chat template (docs/architecture.md) makes the model emit

    [<|think|>{reasoning}]<|call|>{compact JSON list of {"name", "arguments"}}<|end|>

``parse_calls(text)`` turns the decoded text of that turn (with or without the trailing
``<|end|>``) into a :class:`ParsedCall`. It never raises: anything malformed (no ``<|call|>``,
broken JSON, a non-list, a call without a string name or an object of arguments, text after
the JSON) gives ``calls=None`` and a one-line ``error`` saying why, so the metrics can count it.

    from needle.eval.parse import parse_calls
    parse_calls('<|call|>[{"name":"f","arguments":{"x":1}}]').calls
    # [{'name': 'f', 'arguments': {'x': 1}}]
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

THINK = "<|think|>"
CALL = "<|call|>"
END = "<|end|>"
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
    try:
        value, end = json.JSONDecoder().raw_decode(payload)
    except json.JSONDecodeError as exc:
        return ParsedCall(None, f"invalid JSON: {exc.msg} at char {exc.pos}", reasoning)
    if payload[end:].strip():
        return ParsedCall(None, f"text after the JSON at char {end}", reasoning)
    if not isinstance(value, list):
        return ParsedCall(None, f"call JSON is a {type(value).__name__}, not a list", reasoning)
    for i, call in enumerate(value):
        problem = _check_call(i, call)
        if problem:
            return ParsedCall(None, problem, reasoning)
    return ParsedCall(value, None, reasoning)
