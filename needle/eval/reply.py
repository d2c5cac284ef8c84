"""One generated assistant turn read back as what it is: tool calls, or an answer in words.

A model that serves an agent either calls tools or, after their results, answers in text.
``read_reply(fmt, text)`` decides which by the same rule the ``auto`` grammar writes
(needle/eval/constrain.py): a turn that opens the format's call syntax (``<|call|>`` in needle's
template, ``<tool_call>`` in Needle 3's and Qwen's, a leading ``[``/``{`` in the JSON formats,
``<start_function_call>`` in FunctionGemma's) is parsed as calls, strictly, by the format's own
parser; anything else is text. An empty call list (needle's ``<|call|>[]``, the trained
"no tool fits" answer) reads as the empty text answer, as OpenAI shows a turn without calls.

    r = read_reply(fmt, tok.decode(ids))
    r.calls      # non-empty call list, or None
    r.content    # the text answer (reasoning and end markers removed), or None
    r.error      # why the turn is neither, or None
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from needle.data.parse import strip_think
from needle.eval.constrain import UnsupportedFormat, format_kind
from needle.tokenizers.base import CALL, END, THINK
from needle.tokenizers.markers import IM_END

_OPENERS = {"native": CALL, "needle3": "<tool_call>", "hermes": "<tool_call>",
            "function_gemma": "<start_function_call>"}  # fmt: skip
_ENDS = (END, IM_END, "<|eot_id|>", "<|eom_id|>", "<end_of_turn>")


@dataclass(frozen=True)
class Reply:
    """Calls (a non-empty list), or text content, or the error that makes the turn neither."""

    calls: list[dict[str, Any]] | None = None
    content: str | None = None
    error: str | None = None


def opens_calls(kind: str, text: str) -> bool:
    """Whether ``text`` holds format ``kind``'s call syntax (for the JSON formats: starts with it,
    after any reasoning block)."""
    if kind == "native":
        return CALL in text or text.lstrip().startswith(THINK)  # parse_calls splits needle's <|think|>
    opener = _OPENERS.get(kind)
    if opener is not None:
        return opener in text
    body = strip_think(text)[1].lstrip()
    return body[:1] in ("[", "{") or body.startswith(("```", "<|python_tag|>"))


def _text(text: str) -> str:
    body = strip_think(text)[1].strip()
    for end in _ENDS:
        body = body.removesuffix(end).rstrip()
    return body


def read_reply(fmt: Any, text: str) -> Reply:
    """The turn ``text`` (decoded, stop id excluded) in chat format ``fmt`` as calls or text; never raises."""
    try:
        kind = format_kind(fmt)
    except UnsupportedFormat:  # a format without a known call syntax: calls if they parse, else text
        parsed = fmt.parse(text)
        return Reply(calls=parsed.calls) if parsed.ok and parsed.calls else Reply(content=_text(text))
    if not opens_calls(kind, text):
        return Reply(content=_text(text))
    parsed = fmt.parse(text)
    if not parsed.ok:
        return Reply(error=parsed.error)
    return Reply(calls=parsed.calls) if parsed.calls else Reply(content="")
