"""The prompt of a served conversation, rendered exactly as training renders it.

A chat request holds the conversation so far (OpenAI messages: system, user, assistant turns
with ``tool_calls``, ``tool`` results) and asks for the next assistant turn. The conversation is
validated as a data row's (needle/data/conversation.py: roles in order, calls on offered tools
with schema-valid arguments, every result answering an earlier call, every call answered), with
a placeholder assistant turn appended; the model's own format then encodes it as training does
(``encode_conversation``: needle's template, a model's Jinja template, Needle 3's turns, each
segment tokenized on its own), and the prompt is every id before that last turn
(``conversation_prompt``, needle/data/turns.py, which evaluation uses for each held-out turn): the
conversation so far plus the start of the next assistant turn (``<|assistant|>``,
``<|im_start|>assistant\\n``, the template's generation prompt).

    Request(messages=body["messages"], tools=tools, mode="auto")
    row = conversation_row(body["messages"], tools)     # ValueError naming the message
    ids = conversation_prompt(fmt, row, tok)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from needle.data.schema import Row, parse_row
from needle.data.turns import conversation_prompt

__all__ = ["PLACEHOLDER", "Answer", "Request", "conversation_prompt", "conversation_row"]

PLACEHOLDER = {"role": "assistant", "content": None, "tool_calls": []}


@dataclass(frozen=True)
class Request:
    """One request to the served model (needle/serve/engine.py): a ``query`` or the conversation so
    far (``messages``), its tools, the grammar's ``mode`` (needle/eval/constrain.py ``MODES``),
    for a named ``tool_choice`` the ``only`` tool it may call, the answer's token budget
    (``max_tokens``; None: the server's) and the ``stop`` strings that end a text answer."""

    query: Any = None
    tools: Any = None
    messages: Any = None
    mode: str = "calls"
    only: str | None = None
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()


@dataclass(frozen=True)
class Answer:
    """The engine's answer to one :class:`Request`: calls, ``{"content", "finished"}`` or an error
    object, with the tokens of the prompt as the model saw it, the tokens decoded (the stop id
    included; zero for a request refused before decoding) and whether the budget ran out before
    the end marker (``cut``)."""

    prediction: Any
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cut: bool = False


def _as_trained(msg: Any) -> Any:
    """``developer`` read as ``system``; an assistant turn with no text and no calls as ``tool_calls: []``.

    The second is how this server answers "no offered tool fits" (``content: ""``, no calls), so a
    client that sends its history back gets the empty call list training rendered, not a 400.
    """
    if not isinstance(msg, dict):
        return msg
    if msg.get("role") == "developer":
        return {**msg, "role": "system"}
    if msg.get("role") == "assistant" and not msg.get("tool_calls") and not (msg.get("content") or "").strip():
        return {**msg, "content": None, "tool_calls": []}
    return msg


def conversation_row(messages: Any, tools: Any, source: str = "request") -> Row:
    """The validated row of the conversation so far plus :data:`PLACEHOLDER`; ValueError saying why not.

    OpenAI's ``developer`` role is read as ``system``. The conversation must end with a user
    message or tool results: the model writes the assistant turn that follows.
    """
    if hasattr(messages, "tolist"):  # a numpy array from a DataFrame cell
        messages = messages.tolist()
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    msgs = [_as_trained(m) for m in messages]
    last = msgs[-1].get("role") if isinstance(msgs[-1], dict) else None
    if last == "assistant" and msgs[-1].get("tool_calls"):
        raise ValueError(f"messages[{len(msgs) - 1}] (assistant) calls tools whose results are missing: send a "
                         "tool message per call id, then the model answers")  # fmt: skip
    if last not in ("user", "tool"):
        raise ValueError(f"messages[{len(msgs) - 1}] ({last}): the conversation must end with a user message or "
                         "tool results (the model writes the assistant turn that follows)")  # fmt: skip
    try:
        return parse_row({"messages": [*msgs, PLACEHOLDER], "tools": tools}, source)
    except ValueError as exc:
        raise ValueError(f"invalid conversation: {exc}") from None
