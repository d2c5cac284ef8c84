"""``stream: true``: a reply sent as OpenAI's server-sent event chunks while it is decoded.

``live(predictor, body, model_name)`` decodes one chat body on a worker thread (the same batched,
constrained decode as without ``stream``, needle/serve/engine.py) with an ``on_token`` hook: each
token, as the decoder chooses it, goes through a :class:`TextStream`, and the text it adds leaves
at once as a ``delta.content`` chunk, so the first words reach the client while the rest is still
being decoded. The chunks are the ``chat.completion.chunk`` events an OpenAI server sends, which
the ``openai`` client's streaming API reads: a first delta with the role (sent with the first
decoded token); the text as it is decoded; each call, once the call list is complete, as a
``tool_calls`` delta with its ``index``, ``id``, ``type`` and name followed by its arguments in
pieces of ``ARGS_PIECE`` characters; a last choice chunk with an empty delta and the
``finish_reason``; with ``stream_options: {"include_usage": true}``, as OpenAI does, every chunk
has ``"usage": null`` and one more chunk follows with no choices and the reply's ``usage``; then
``data: [DONE]``. Concatenated, the pieces are the non-streamed reply exactly. A request refused
before decoding is still a 400 with the error object (``live`` answers it instead of a stream); a
fault after the stream began is OpenAI's error object as the last event.

:class:`TextStream` detokenises incrementally: the turn so far is decoded and read as the
non-streamed reply reads it (needle/eval/reply.py), and only text that no later token can change
is sent: not a half-decoded character (``\\ufffd``), not trailing spaces, not the start of a stop
string, a call opener, a reasoning block or an end marker. A turn that opens a call list sends no
text; a text answer ends at its first ``stop`` string, as without ``stream``.

``chunks(completion)`` gives the same chunks for an already decoded ``chat.completion`` (its text
word by word).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

from needle.eval.reply import _ENDS, read_reply
from needle.serve.requests import ParamError, chat_answer, chat_error, stop_strings
from needle.tokenizers.base import CALL

_PIECE = re.compile(r"\s*\S+|\s+")  # a word with the spaces before it
ARGS_PIECE = 16  # characters of a call's arguments per delta
DONE = "data: [DONE]\n\n"
_MARKERS = ("<think>", "<tool_call>", CALL, *_ENDS)  # text that a later token may turn into syntax


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


class TextStream:
    """A reply's text as its tokens arrive: ``push(id)`` returns the text to send now ("" for none;
    module doc). Joined, the pieces are a prefix of the reply's ``content``."""

    def __init__(self, tok: Any, fmt: Any, stops: Sequence[str] = ()) -> None:
        self.tok, self.fmt, self.stops = tok, fmt, tuple(s for s in stops if s)
        self.stop_ids = {int(i) for i in tok.stop_ids}
        self.ids: list[int] = []
        self.sent = ""
        self.in_words = False  # whether the turn so far reads as text
        self.over = False  # a stop string was met, or the turn stopped reading as the text sent

    def push(self, token: int) -> str:
        self.over = self.over or int(token) in self.stop_ids  # the turn has ended
        if self.over:
            return ""
        self.ids.append(int(token))
        content = read_reply(self.fmt, self.tok.decode(self.ids)).content
        self.in_words = content is not None
        if not content or (content.startswith("<think>") and "</think>" not in content):
            return ""
        cuts = [content.find(s) for s in self.stops if s in content]
        if cuts:
            content, self.over = content[: min(cuts)], True
        else:
            content = content[: len(content) - _held(content, (*self.stops, *_MARKERS))].rstrip("\ufffd")
        if not content.startswith(self.sent):
            self.over = True  # a later token rewrote what was sent: the rest waits for the whole reply
            return ""
        piece, self.sent = content[len(self.sent) :], content
        return piece


def _held(text: str, markers: Sequence[str]) -> int:
    """The length of the longest end of ``text`` that begins one of ``markers``."""
    return max((n for m in markers for n in range(min(len(m), len(text)), 0, -1) if m.startswith(text[-n:])),
               default=0)  # fmt: skip


def _chunk(head: dict[str, Any], delta: dict[str, Any], finish: str | None = None,
           with_usage: bool = False) -> dict[str, Any]:  # fmt: skip
    choices = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
    return {**head, "object": "chat.completion.chunk", "choices": choices, **({"usage": None} if with_usage else {})}


def _role(head: dict[str, Any], words: bool, with_usage: bool) -> dict[str, Any]:
    return _chunk(head, {"role": "assistant", "content": "" if words else None, "refusal": None}, None, with_usage)


def tail_chunks(completion: dict[str, Any], head: dict[str, Any], sent: str = "",
                with_usage: bool = False) -> Iterator[dict[str, Any]]:  # fmt: skip
    """The chunks of ``completion`` after the role and the text ``sent`` already: the rest of the
    text word by word, the calls, the finish reason, the usage when asked."""
    choice = completion["choices"][0]
    message = choice["message"]
    content = message.get("content") or ""
    for piece in pieces(content[len(sent) :] if content.startswith(sent) else ""):
        yield _chunk(head, {"content": piece}, None, with_usage)
    for i, call in enumerate(message.get("tool_calls") or []):
        fn = call["function"]
        opening = {"index": i, "id": call["id"], "type": call["type"], "function": {"name": fn["name"], "arguments": ""}}
        yield _chunk(head, {"tool_calls": [opening]}, None, with_usage)
        args = fn["arguments"]
        for start in range(0, len(args), ARGS_PIECE):
            part = {"index": i, "function": {"arguments": args[start : start + ARGS_PIECE]}}
            yield _chunk(head, {"tool_calls": [part]}, None, with_usage)
    yield _chunk(head, {}, choice["finish_reason"], with_usage)
    if with_usage:
        yield {**head, "object": "chat.completion.chunk", "choices": [], "usage": completion["usage"]}


def chunks(completion: dict[str, Any], with_usage: bool = False) -> Iterator[dict[str, Any]]:
    """The ``chat.completion.chunk`` objects of a decoded ``chat.completion``, cut word by word."""
    head = {k: completion[k] for k in ("id", "created", "model")}
    yield _role(head, not completion["choices"][0]["message"].get("tool_calls"), with_usage)
    yield from tail_chunks(completion, head, "", with_usage)


def sse(item: dict[str, Any]) -> str:
    return f"data: {json.dumps(item, ensure_ascii=False, separators=(',', ':'))}\n\n"


def sse_events(items: Iterator[dict[str, Any]]) -> Iterator[str]:
    """Each item as a server-sent event (``data: {json}``), then ``data: [DONE]``."""
    yield from map(sse, items)
    yield DONE


async def live(predictor: Any, body: dict[str, Any], model_name: str) -> tuple[dict[str, Any] | None,
                                                                              AsyncIterator[str] | None]:  # fmt: skip
    """``(error object, None)`` for a body refused before any token was decoded, else ``(None,
    events)``: the reply's server-sent events, each sent as soon as its text is decoded (module doc)."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
    try:
        stops = stop_strings(body)
    except ParamError:
        stops = ()  # refused by chat_answer, before decoding
    text = TextStream(predictor.tok, predictor.fmt, stops)

    heard = []

    def on_token(token: int) -> None:  # on the decoding thread; the first token starts the stream
        piece = text.push(token)
        if piece or not heard:
            heard.append(token)
            loop.call_soon_threadsafe(queue.put_nowait, ("text", (piece, text.in_words)))

    def work() -> None:
        try:
            done = chat_answer(predictor, body, True, model_name, on_token)
        except Exception as exc:  # noqa: BLE001  # the client gets an error, the server keeps serving
            done = chat_error(f"internal error: {type(exc).__name__}: {exc}", kind="server_error")
        loop.call_soon_threadsafe(queue.put_nowait, ("done", done))

    worker = loop.run_in_executor(None, work)
    kind, first = await queue.get()
    if kind == "done" and "error" in first:
        return first, None
    head = {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "created": int(time.time()),
            "model": str(body.get("model") or model_name)}  # fmt: skip
    return None, _events(head, include_usage(body), (kind, first), queue, worker)


async def _events(head: dict[str, Any], with_usage: bool, first: tuple[str, Any], queue: asyncio.Queue,
                  worker: Any) -> AsyncIterator[str]:  # fmt: skip
    kind, item = first
    words = not item["choices"][0]["message"].get("tool_calls") if kind == "done" else item[1]
    yield sse(_role(head, words, with_usage))
    sent = ""
    while kind == "text":
        if item[0]:
            sent += item[0]
            yield sse(_chunk(head, {"content": item[0]}, None, with_usage))
        kind, item = await queue.get()
    await worker
    if "error" in item:  # the server's fault after the stream began
        yield sse(item)
    else:
        for part in tail_chunks(item, head, sent, with_usage):
            yield sse(part)
    yield DONE
