"""Conversation rows: the OpenAI chat layout ``{"messages": [...], "tools": [...]}``, validated.

A conversation is what an agent sees: the user asks, the model calls tools, their results come
back, and the model calls again or answers in words. Messages (OpenAI's chat format, the layout
TRL's SFT trainer and the OpenAI fine-tuning API take)::

    {"role": "system", "content": "..."}                         only as the first message
    {"role": "user", "content": "..."}
    {"role": "assistant", "content": "...", "tool_calls": [{"id": "c1", "type": "function",
        "function": {"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}}],
        "reasoning_content": "..."}                               content and/or tool_calls
    {"role": "tool", "tool_call_id": "c1", "content": "..."}

``content`` is a string or a list of ``{"type": "text", "text": ...}`` parts (joined); call
``arguments`` a JSON string or an object. An assistant turn with ``"tool_calls": []`` and no text
is the off-topic answer of a query/answers row (``answers: []``). What is checked, each error
naming the message (``messages[3] (tool): ...``): the conversation is not empty; roles come in a
legal order (an optional system message first, then a user message; a user message is answered
by the assistant; a turn that calls tools is followed by their results, or ends the
conversation; a result is followed by another result or the assistant; the conversation ends
with an assistant turn, the last thing the model learns); every call names an offered tool and
its arguments fit the tool's schema; call ids are unique; every tool message answers an earlier,
not yet answered call id of the same turn; every call of a turn is answered before the
conversation moves on.

:func:`parse_messages` returns the canonical messages (OpenAI-shaped, so a canonical row reads
back unchanged: text joined, arguments objects, ``type: "function"`` on each call, tool
messages carrying the called tool's ``name``); :func:`derived_fields` gives the query/answers
view of the last turns; :func:`row_messages` gives any row's conversation, a query/answers row
being the two (or three, with ``system``) message conversation it always was.
"""

from __future__ import annotations

from typing import Any

from needle.data.bounds import check_surrogates, decode_json_field, parse_call

ROLES = ("system", "user", "assistant", "tool")
# What may follow each message; "calls" is an assistant turn with tool calls, "assistant" one without.
_NEXT = {
    "system": {"user"},
    "user": {"assistant", "calls"},
    "assistant": {"user"},
    "calls": {"tool"},
    "tool": {"tool", "assistant", "calls"},
}


def _text(value: Any, where: str, *, allow_empty: bool) -> str:
    """A message's ``content``: a string or a list of text parts, joined."""
    if isinstance(value, list):
        parts = []
        for j, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"{where} content[{j}] must be a text part {{\"type\": \"text\", \"text\": str}}")
            parts.append(part["text"])
        value = "".join(parts)
    if not isinstance(value, str):
        raise ValueError(f"{where} 'content' must be a string or a list of text parts, got {type(value).__name__}")
    if not allow_empty and not value.strip():
        raise ValueError(f"{where} 'content' must be non-empty text")
    return value


def _parse_call(call: Any, j: int, where: str, tools: dict[str, dict[str, Any]]) -> dict[str, Any]:
    at = f"{where} tool_calls[{j}]"
    if not isinstance(call, dict):
        raise ValueError(f"{at} must be an object, got {type(call).__name__}")
    if call.get("type", "function") != "function":
        raise ValueError(f"{at} has type {call.get('type')!r}; only 'function' calls are supported")
    fn = call.get("function", call)  # {"function": {...}} as OpenAI writes it, or the call itself
    if not isinstance(fn, dict):
        raise ValueError(f"{at} 'function' must be an object")
    out: dict[str, Any] = {"type": "function", "function": parse_call(fn, at, tools)}
    call_id = call.get("id")
    if call_id is not None:
        if not isinstance(call_id, str) or not call_id:
            raise ValueError(f"{at} 'id' must be a non-empty string")
        out = {"id": call_id, **out}
    return out


def _optional_text(msg: dict[str, Any], where: str) -> str | None:
    for key in ("reasoning_content", "reasoning"):
        value = msg.get(key)
        if value is not None:
            if not isinstance(value, str):
                raise ValueError(f"{where} '{key}' must be a string")
            return value or None
    return None


def _parse_assistant(msg: dict[str, Any], where: str, tools: dict[str, dict[str, Any]]) -> dict[str, Any]:
    raw_calls = msg.get("tool_calls")
    content = msg.get("content")
    text = None if content is None else _text(content, where, allow_empty=True)
    if raw_calls is not None and not isinstance(raw_calls, list):
        raise ValueError(f"{where} 'tool_calls' must be a list, got {type(raw_calls).__name__}")
    calls = [_parse_call(c, j, where, tools) for j, c in enumerate(raw_calls or [])]
    if not calls and not (text or "").strip() and raw_calls is None:
        raise ValueError(f"{where} has neither text 'content' nor 'tool_calls' (\"tool_calls\": [] is the "
                         "answer that no offered tool fits)")  # fmt: skip
    out: dict[str, Any] = {"role": "assistant", "content": text or None}
    if raw_calls is not None:
        out["tool_calls"] = calls
    reasoning = _optional_text(msg, where)
    if reasoning is not None:
        out["reasoning_content"] = reasoning
    return out


def parse_messages(value: Any, tools: dict[str, dict[str, Any]], parsed_bounded: bool) -> list[dict[str, Any]]:
    """Validate a conversation's ``messages`` against the row's tools; the canonical messages."""
    raw = decode_json_field(value, "messages", parsed_bounded)
    if not isinstance(raw, list):
        raise ValueError(f"'messages' must be a list, got {type(raw).__name__}")
    if not raw:
        raise ValueError("'messages' is empty: a conversation needs a user message and an assistant turn")
    out: list[dict[str, Any]] = []
    call_ids: dict[str, str] = {}  # every call id of the conversation -> its tool name
    pending: dict[str, str] = {}  # ids of the last calling turn not yet answered
    prev: str | None = None
    for i, msg in enumerate(raw):
        if not isinstance(msg, dict):
            raise ValueError(f"messages[{i}] must be an object, got {type(msg).__name__}")
        role = msg.get("role")
        where = f"messages[{i}] ({role})"
        if role not in ROLES:
            raise ValueError(f"messages[{i}] has role {role!r}; expected one of {', '.join(ROLES)}")
        if not parsed_bounded:
            check_surrogates(msg)  # a decoded row (hub, Python caller) was never checked by a parser
        if role == "assistant":
            parsed = _parse_assistant(msg, where, tools)
            kind = "calls" if parsed.get("tool_calls") else "assistant"
        else:
            kind = role
        allowed = {"system", "user"} if prev is None else _NEXT[prev]
        if kind not in allowed:
            after = "the start" if prev is None else f"messages[{i - 1}] ({'assistant' if prev == 'calls' else prev})"
            if prev is None and kind != "system":
                raise ValueError(f"{where} cannot come first: a conversation starts with a system or user message")
            raise ValueError(f"{where} cannot follow {after}: roles out of order")
        if prev == "tool" and kind != "tool" and pending:
            raise ValueError(f"{where}: call id(s) {', '.join(sorted(pending))} of the turn before have no tool result")
        if role == "system":
            parsed = {"role": "system", "content": _text(msg.get("content"), where, allow_empty=False)}
        elif role == "user":
            parsed = {"role": "user", "content": _text(msg.get("content"), where, allow_empty=False)}
        elif role == "tool":
            call_id = msg.get("tool_call_id")
            if not isinstance(call_id, str) or not call_id:
                raise ValueError(f"{where} needs a 'tool_call_id' naming the call it answers")
            if call_id not in pending:
                why = "was already answered" if call_id in call_ids else "answers no earlier call of this conversation"
                raise ValueError(f"{where} tool_call_id {call_id!r} {why}")
            name = pending.pop(call_id)
            if msg.get("name") not in (None, name):
                raise ValueError(f"{where} names tool {msg.get('name')!r} but call {call_id!r} called {name!r}")
            content = _text(msg.get("content", ""), where, allow_empty=True)
            parsed = {"role": "tool", "tool_call_id": call_id, "name": name, "content": content}
        elif kind == "calls":
            pending = {}
            for j, call in enumerate(parsed["tool_calls"]):
                call_id = call.get("id")
                if call_id is None:
                    continue
                if call_id in call_ids:
                    raise ValueError(f"{where} tool_calls[{j}] id {call_id!r} is used twice in this conversation")
                call_ids[call_id] = pending[call_id] = call["function"]["name"]
        out.append(parsed)
        prev = kind
    if prev not in ("assistant", "calls"):
        raise ValueError(f"messages[{len(raw) - 1}] ({prev}): a conversation must end with an assistant turn "
                         "(the last thing the model learns)")  # fmt: skip
    return out


def calls_of(message: dict[str, Any]) -> list[dict[str, Any]]:
    """An assistant message's calls as ``{name, arguments}`` (the ``answers`` form)."""
    return [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
            for c in message.get("tool_calls") or []]  # fmt: skip


def derived_fields(messages: list[dict[str, Any]]) -> tuple[str, list[dict[str, Any]], str | None, str | None]:
    """(query, answers, reasoning, system) of a conversation: its last user message, the calls
    and reasoning of its last assistant turn (``[]`` when that turn answers in words), its system
    message. What single-turn consumers of a row read."""
    query = next(m["content"] for m in reversed(messages) if m["role"] == "user")
    last = messages[-1]
    system = messages[0]["content"] if messages[0]["role"] == "system" else None
    return query, calls_of(last), last.get("reasoning_content"), system


def row_messages(row: Any) -> list[dict[str, Any]]:  # a schema.Row (schema imports this module)
    """The canonical conversation of any row: its messages, or for a query/answers row
    ``[system?, user, assistant with tool_calls = answers]`` (``[]`` off-topic)."""
    if row.messages is not None:
        return row.messages
    out: list[dict[str, Any]] = [{"role": "system", "content": row.system}] if row.system else []
    out.append({"role": "user", "content": row.query})
    calls = [{"type": "function", "function": {"name": a["name"], "arguments": a["arguments"]}} for a in row.answers]
    answer: dict[str, Any] = {"role": "assistant", "content": None, "tool_calls": calls}
    if row.reasoning:
        answer["reasoning_content"] = row.reasoning
    out.append(answer)
    return out


def assistant_turns(messages: list[dict[str, Any]]) -> list[int]:
    """Indices of the assistant messages (the turns that carry loss)."""
    return [i for i, m in enumerate(messages) if m["role"] == "assistant"]
