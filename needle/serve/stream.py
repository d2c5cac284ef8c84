"""``stream: true``: a ``chat.completion`` as OpenAI's server-sent event chunks.

The reply is decoded whole (one constrained, batched decode, as without ``stream``) and then sent
as the ``chat.completion.chunk`` events an OpenAI server sends, which the ``openai`` client's
streaming API reads: a first delta with the role; the text word by word (``delta.content``), or
each call as a ``tool_calls`` delta with its ``index``, ``id``, ``type`` and name followed by
its arguments in pieces of ``ARGS_PIECE`` characters; a last choice chunk with an empty delta
and the ``finish_reason``; with ``stream_options: {"include_usage": true}``, as OpenAI does, every
chunk has ``"usage": null`` and one more chunk follows with no choices and the reply's ``usage``;
then ``data: [DONE]``. Concatenated, the pieces are the non-streamed reply exactly. (The first
piece leaves when the whole turn is decoded: this is OpenAI's streaming protocol, not an earlier
first token.)

    for event in sse_events(chunks(completion, include_usage(body))):   # what /v1/chat/completions sends
        ...
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

from needle.serve.requests import ParamError

_PIECE = re.compile(r"\s*\S+|\s+")  # a word with the spaces before it
ARGS_PIECE = 16  # characters of a call's arguments per delta


def pieces(text: str) -> list[str]:
    """``text`` cut into words, each with the spaces before it; joined, ``text``."""
    return _PIECE.findall(text)


def include_usage(body: dict[str, Any]) -> bool:
    """Whether a streamed reply ends with a usage chunk (``stream_options.include_usage``); ParamError
    naming ``stream_options`` for a malformed one."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise ParamError('stream_options must be an object such as {"include_usage": true}', "stream_options")
    return options.get("include_usage", False)


def chunks(completion: dict[str, Any], with_usage: bool = False) -> Iterator[dict[str, Any]]:
    """The ``chat.completion.chunk`` objects of a ``chat.completion`` (module doc)."""
    head = {k: completion[k] for k in ("id", "created", "model")}
    choice = completion["choices"][0]
    message = choice["message"]
    tail = {"usage": None} if with_usage else {}

    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        choices = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
        return {**head, "object": "chat.completion.chunk", "choices": choices, **tail}

    calls = message.get("tool_calls") or []
    yield chunk({"role": "assistant", "content": None if calls else "", "refusal": None})
    for piece in pieces(message.get("content") or ""):
        yield chunk({"content": piece})
    for i, call in enumerate(calls):
        fn = call["function"]
        yield chunk({"tool_calls": [{"index": i, "id": call["id"], "type": call["type"],
                                     "function": {"name": fn["name"], "arguments": ""}}]})  # fmt: skip
        args = fn["arguments"]
        for start in range(0, len(args), ARGS_PIECE):
            yield chunk({"tool_calls": [{"index": i, "function": {"arguments": args[start : start + ARGS_PIECE]}}]})
    yield chunk({}, choice["finish_reason"])
    if with_usage:
        yield {**head, "object": "chat.completion.chunk", "choices": [], "usage": completion["usage"]}


def sse_events(items: Iterator[dict[str, Any]]) -> Iterator[str]:
    """Each item as a server-sent event (``data: {json}``), then ``data: [DONE]``."""
    for item in items:
        yield f"data: {json.dumps(item, ensure_ascii=False, separators=(',', ':'))}\n\n"
    yield "data: [DONE]\n\n"
