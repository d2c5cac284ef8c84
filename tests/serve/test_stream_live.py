"""``stream: true`` sends the reply while it is decoded (issue 30, item 4): the text token by token,
the first piece on the wire before the last token is decoded; joined, the pieces are the reply
without ``stream``. :class:`TextStream` sends only text no later token can change."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from needle.serve.pyfunc import EXAMPLE_TOOLS
from needle.serve.stream import TextStream
from serve_helpers import free_port, post

TOOLS = [{"type": "function", "function": EXAMPLE_TOOLS[0]}]
MESSAGES = [{"role": "user", "content": "Text Bob that dinner is at 8"}]
STOP = 0


class ByteTok:
    """Token ``i`` is ``PIECES[i]``'s bytes; a cut character decodes as U+FFFD, as a byte-level BPE's does."""

    PIECES = [b"", b"Hel", b"lo", b" ", b"wor", b"ld", b"caf", b"\xc3", b"\xa9", b"#", b"<|call|>", b"[]", b"<", b"b"]
    stop_ids = [STOP]

    def decode(self, ids):
        return b"".join(self.PIECES[i] for i in ids).decode("utf-8", "replace")


def _pushed(fmt, ids, stops=()):
    stream = TextStream(ByteTok(), fmt, stops)
    return [stream.push(i) for i in ids]


def test_text_stream_sends_only_text_that_no_later_token_changes(eval_tokenizer) -> None:
    from needle.data.chat import format_for

    fmt = format_for(eval_tokenizer)  # needle's own: calls open with <|call|>
    # Words as they come; a trailing space waits for the word after it; nothing after the stop id.
    assert _pushed(fmt, [1, 2, 3, 4, 5, STOP, 4]) == ["Hel", "lo", "", " wor", "ld", "", ""]
    assert _pushed(fmt, [6, 7, 8, 3]) == ["caf", "", "é", ""]  # a character cut between tokens waits
    # A stop string: what may begin it waits, the text ends before it, nothing follows.
    assert _pushed(fmt, [1, 9, 13, 9, 9, 2], ["##"]) == ["Hel", "", "#b", "", "", ""]
    assert _pushed(fmt, [1, 12, 13], ["<b"]) == ["Hel", "", ""]
    assert _pushed(fmt, [12, 13]) == ["", "<b"]  # "<" might have begun a marker; "<b" is none
    assert _pushed(fmt, [10, 11, 1]) == ["", "", ""]  # a call list (here: empty) sends no text


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """`needle serve`'s app for the tiny model in this process (uvicorn on a thread), whose decoder
    notes the time of each streamed token and takes 20 ms a token: (base URL, the token times)."""
    import uvicorn

    from needle.serve.http import build_app, load_pyfunc

    model = load_pyfunc(str(tiny_model_dir), tmp_path_factory.mktemp("live"))
    app = build_app(model)
    predictor = model.unwrap_python_model().predictor
    real, ticks = predictor.predict_detailed, []

    def slow(requests, constrained=True, on_token=None):
        if on_token is None:
            return real(requests, constrained)

        def hear(i, token):
            ticks.append(time.monotonic())
            time.sleep(0.02)
            on_token(i, token)

        return real(requests, constrained, on_token=hear)

    predictor.predict_detailed = slow
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", ticks
    server.should_exit = True
    thread.join(30)


def _stream(url: str, body: dict) -> list[tuple[float, dict]]:
    """POST ``body`` with ``stream: true``; each event's arrival time and JSON, read as it arrives."""
    data = json.dumps({**body, "stream": True, "stream_options": {"include_usage": True}}).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    events = []
    with urllib.request.urlopen(req, timeout=120) as resp:
        assert resp.headers.get_content_type() == "text/event-stream"
        for line in iter(resp.readline, b""):
            if line.startswith(b"data: "):
                events.append((time.monotonic(), line[len(b"data: ") :].strip().decode()))
    assert events[-1][1] == "[DONE]"
    return [(t, json.loads(e)) for t, e in events[:-1]]


@pytest.mark.parametrize("extra", [{"tool_choice": "none"}, {"tool_choice": "auto", "constrained": False},
                                   {"tool_choice": "none", "stop": ["cu"]}])  # fmt: skip
def test_a_streamed_text_answer_is_sent_token_by_token_while_it_is_decoded(served, extra: dict) -> None:
    base, ticks = served
    url = f"{base}/v1/chat/completions"
    body = {"model": "needle", "messages": MESSAGES, "tools": TOOLS, **extra}
    status, whole = post(url, body)
    assert status == 200, whole
    message = whole["choices"][0]["message"]  # type: ignore[index]
    assert message["content"] and not message.get("tool_calls"), whole  # the tiny model answers in words
    ticks.clear()
    events = _stream(url, body)
    texts = [(t, e["choices"][0]["delta"]["content"]) for t, e in events
             if e["choices"] and e["choices"][0]["delta"].get("content")]  # fmt: skip
    assert "".join(text for _, text in texts) == message["content"]  # the reply without stream, exactly
    assert events[-1][1]["usage"] == whole["usage"]  # type: ignore[index]
    assert events[-2][1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]  # type: ignore[index]
    made = whole["usage"]["completion_tokens"]  # type: ignore[index]
    assert len(ticks) >= made  # each decoded token went through the stream (a stop string ends the text, not the decode)
    if not extra.get("stop"):
        # Token by token: about one piece a token (a piece waits while a later token may change it) ...
        assert made // 2 <= len(texts) <= made, (len(texts), made)
    # ... and the first piece reached the client before the decoder chose the last token.
    assert texts[0][0] < ticks[-1], (texts[0][0] - ticks[0], ticks[-1] - ticks[0])


def test_a_streamed_call_list_is_the_reply_without_stream(served) -> None:
    base, ticks = served
    url = f"{base}/v1/chat/completions"
    body = {"model": "needle", "messages": MESSAGES, "tools": TOOLS, "tool_choice": "required"}
    status, whole = post(url, body)
    assert status == 200 and whole["choices"][0]["finish_reason"] == "tool_calls", whole  # type: ignore[index]
    events = [e for _, e in _stream(url, body)]
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": None, "refusal": None}
    parts = [p for e in events if e["choices"] for p in e["choices"][0]["delta"].get("tool_calls", [])]
    calls = whole["choices"][0]["message"]["tool_calls"]  # type: ignore[index]
    assert [p["function"]["name"] for p in parts if "id" in p] == [c["function"]["name"] for c in calls]
    assert "".join(p["function"]["arguments"] for p in parts) == "".join(c["function"]["arguments"] for c in calls)
    assert events[-1]["usage"] == whole["usage"] and not any(  # type: ignore[index]
        e["choices"][0]["delta"].get("content") for e in events if e["choices"])
    # A request refused before decoding is still a 400 with OpenAI's error object, not a stream.
    status, refused = post(url, {**body, "stream": True, "tool_choice": {"type": "function",
                                                                          "function": {"name": "nope"}}})  # fmt: skip
    assert status == 400 and "nope" in refused["error"]["message"]  # type: ignore[index]
