"""Request shapes of the served model, with a stand-in predictor (no model, milliseconds)."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from needle.serve.prompt import Answer, Request
from needle.serve.requests import answer

TOOL = {"name": "send_message", "parameters": {"type": "object", "properties": {"contact": {"type": "string"}}}}
CALL = {"name": "send_message", "arguments": {"contact": "Bob"}}


class FakePredictor:
    """Answers every request with ``reply``, a 12-token prompt and a 5-token completion (``cut``:
    the budget ran out before the end marker)."""

    def __init__(self, reply, cut=False):
        self.reply, self.cut, self.seen = reply, cut, []

    def predict_detailed(self, requests, constrained=True):
        self.seen.append((requests, constrained))
        return [Answer(self.reply, 12, 5, self.cut)] * len(requests)


def test_table_rows_get_calls_or_their_own_error() -> None:
    fake = FakePredictor([CALL])
    df = pd.DataFrame({"query": ["text Bob", "x", None], "tools": [json.dumps([TOOL]), "{bad", "[]"]})
    out = answer(fake, df, {})
    assert list(out.columns) == ["calls", "content", "error"]
    assert json.loads(out["calls"][0]) == [CALL] and out["error"][0] is None
    assert out["calls"][1] is None and out["error"][1].startswith("tools is not valid JSON")
    assert out["error"][2] == "missing column 'query'"
    assert fake.seen == [([Request(query="text Bob", tools=[TOOL])], True)]  # only the good row reaches the model
    answer(fake, df.iloc[:1], {"constrained": False})
    assert fake.seen[-1][1] is False


def test_openai_chat_body_answers_tool_calls() -> None:
    fake = FakePredictor([CALL])
    body = {"model": "m", "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "text Bob"}],
            "tools": [{"type": "function", "function": {**TOOL, "strict": True}}]}  # fmt: skip
    out = answer(fake, body, {})
    # The whole conversation goes to the model (system turn included), calls or text allowed.
    assert fake.seen[0][0] == [Request(messages=body["messages"], tools=[TOOL], mode="auto")]
    choice = out["choices"][0]
    assert out["object"] == "chat.completion" and choice["finish_reason"] == "tool_calls"
    call = choice["message"]["tool_calls"][0]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "send_message", "arguments": '{"contact":"Bob"}'}
    # As MLflow hands it over after the signature: a one-row table.
    assert answer(fake, pd.DataFrame([body]), {})["choices"][0]["finish_reason"] == "tool_calls"


def test_chat_without_calls_and_bad_chat_bodies() -> None:
    none = answer(FakePredictor([]), {"messages": [{"role": "user", "content": "hi"}]}, {})
    assert none["choices"][0]["message"]["content"] == "" and none["choices"][0]["finish_reason"] == "stop"
    assert "non-empty list" in answer(FakePredictor([]), {"messages": []}, {})["error"]["message"]
    failing = FakePredictor({"error": "prompt has 900 tokens", "raw": ""})
    out = answer(failing, {"messages": [{"role": "user", "content": "hi"}], "tools": []}, {})
    assert out["error"]["type"] == "invalid_request_error" and "900" in out["error"]["message"]


class BrokenPredictor:
    def predict_detailed(self, requests, constrained=True):
        raise RuntimeError("decoder fault")


def test_a_fault_of_the_server_is_a_server_error_not_the_requests() -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": []}
    out = answer(BrokenPredictor(), body, {})
    assert out["error"]["type"] == "server_error" and "decoder fault" in out["error"]["message"]
    table = answer(BrokenPredictor(), pd.DataFrame({"query": ["hi"], "tools": ["[]"]}), {})
    assert table["error"][0].startswith("internal error: RuntimeError")


CONVERSATION = [
    {"role": "user", "content": "text Bob"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                                                          "function": {"name": "send_message", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "sent"},
]  # fmt: skip


def test_chat_answers_in_text_and_tool_choice_sets_the_mode() -> None:
    text = FakePredictor({"content": "Done, Bob has it.", "finished": True})
    body = {"messages": CONVERSATION, "tools": [TOOL]}
    out = answer(text, body, {})
    choice = out["choices"][0]
    assert choice["message"]["content"] == "Done, Bob has it." and "tool_calls" not in choice["message"]
    assert choice["finish_reason"] == "stop"
    cut = FakePredictor({"content": "Done, B", "finished": False})
    assert answer(cut, body, {})["choices"][0]["finish_reason"] == "length"
    for choice_, mode, only in (("auto", "auto", None), ("none", "none", None), ("required", "required", None),
                                ({"type": "function", "function": {"name": "send_message"}}, "required", "send_message")):
        answer(text, {**body, "tool_choice": choice_}, {})
        assert text.seen[-1][0] == [Request(messages=CONVERSATION, tools=[TOOL], mode=mode, only=only)]
    seen = len(text.seen)
    assert "no tools" in answer(text, {"messages": CONVERSATION, "tool_choice": "required"}, {})["error"]["message"]
    named = {**body, "tool_choice": {"type": "function", "function": {"name": "nope"}}}
    assert "'nope', which is not among the offered tools" in answer(text, named, {})["error"]["message"]
    for malformed in ({"type": "function", "function": "send_message"}, {"type": "function", "function": None}):
        assert "tool_choice must be" in answer(text, {**body, "tool_choice": malformed}, {})["error"]["message"]
    assert len(text.seen) == seen  # refused before the model


def test_table_rows_may_be_conversations() -> None:
    fake = FakePredictor({"content": "Sent.", "finished": True})
    df = pd.DataFrame({"query": [None, "text Bob"], "messages": [CONVERSATION, None], "tools": [[TOOL], [TOOL]]})
    out = answer(fake, df, {})  # a table, not a chat body: it has a query column
    assert fake.seen[0][0] == [Request(messages=CONVERSATION, tools=[TOOL], mode="auto"),
                               Request(query="text Bob", tools=[TOOL])]  # fmt: skip
    assert out["calls"].tolist() == ["[]", "[]"] and out["content"].tolist() == ["Sent.", "Sent."]
    one = answer(fake, df.iloc[:1], {})
    assert list(one.columns) == ["calls", "content", "error"]  # one row with a query column is a table
    both = answer(fake, pd.DataFrame({"query": ["x"], "messages": [CONVERSATION], "tools": [[TOOL]]}), {})
    assert both["error"][0] == "a row has either 'query' or 'messages', not both"
    chat = answer(fake, pd.DataFrame([{"messages": CONVERSATION, "tools": [TOOL]}]), {})
    assert chat["object"] == "chat.completion"  # as MLflow hands a chat body over
    # Each conversation row's own tool_choice sets its mode.
    choices = pd.DataFrame({"query": [None, None, None], "messages": [CONVERSATION] * 3, "tools": [[TOOL]] * 3,
                            "tool_choice": ["none", None, {"type": "function", "function": {"name": "nope"}}]})  # fmt: skip
    out = answer(fake, choices, {})
    assert fake.seen[-1][0] == [Request(messages=CONVERSATION, tools=[TOOL], mode="none"),
                                Request(messages=CONVERSATION, tools=[TOOL], mode="auto")]  # fmt: skip
    assert "'nope', which is not among the offered tools" in out["error"][2]


def test_stream_chunks_reassemble_to_the_reply() -> None:
    from needle.serve.stream import chunks, sse_events

    for reply in ({"content": "It is sunny  in Oslo, 21 °C.", "finished": True}, [CALL, {**CALL, "arguments": {"contact": "Al"}}]):
        out = answer(FakePredictor(reply), {"messages": CONVERSATION, "tools": [TOOL]}, {})
        parts = list(chunks(out))
        assert all(p["object"] == "chat.completion.chunk" and p["id"] == out["id"] for p in parts)
        deltas = [p["choices"][0]["delta"] for p in parts]
        assert deltas[0]["role"] == "assistant" and deltas[-1] == {}
        assert [p["choices"][0]["finish_reason"] for p in parts] == [None] * (len(parts) - 1) + \
            [out["choices"][0]["finish_reason"]]  # fmt: skip
        message = out["choices"][0]["message"]
        assert "".join(d.get("content") or "" for d in deltas) == (message["content"] or "")
        calls: dict = {}
        for d in deltas:
            for part in d.get("tool_calls", []):
                c = calls.setdefault(part["index"], {"id": part.get("id"), "type": part.get("type"),
                                                      "function": {"name": "", "arguments": ""}})
                for key in ("name", "arguments"):
                    c["function"][key] += part.get("function", {}).get(key, "")
        assert [calls[i] for i in sorted(calls)] == message.get("tool_calls", [])
        events = list(sse_events(iter(parts)))
        assert events[-1] == "data: [DONE]\n\n" and all(e.startswith("data: {") for e in events[:-1])
        assert [json.loads(e[len("data: "):]) for e in events[:-1]] == parts


def test_concurrent_callers_share_one_decode(monkeypatch, tiny_model_dir) -> None:
    import threading

    import needle.serve.engine as engine
    from needle.eval.decode import Generation
    from needle.model.io import load_model

    calls, gate = [], threading.Event()

    def fake_generate(model, params, prompts, **kw):
        calls.append(len(prompts))
        gate.wait(5)  # hold the first decode until the other callers have queued
        return Generation([[7]] * len(prompts), [True] * len(prompts), len(prompts))

    monkeypatch.setattr(engine, "generate_detailed", fake_generate)
    predictor = engine.Predictor(load_model(tiny_model_dir))
    results: list = [None] * 4

    def call(i: int) -> None:
        results[i] = predictor.predict([(f"query {i}", [TOOL])], constrained=False)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
    threads[0].start()
    _wait_for(lambda: calls)
    for t in threads[1:]:
        t.start()
    _wait_for(lambda: len(predictor._queue) == 3)  # noqa: SLF001
    gate.set()
    for t in threads:
        t.join(10)
    assert calls == [1, 3]  # the first alone, the three that queued meanwhile together
    assert all(r is not None and len(r) == 1 for r in results)


def _wait_for(condition, seconds: float = 20.0) -> None:
    import time

    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_chat_replies_carry_usage_and_a_cut_turn_is_length_not_an_error() -> None:
    body = {"messages": CONVERSATION, "tools": [TOOL]}
    for reply, finish in (([CALL], "tool_calls"), ({"content": "Sent.", "finished": True}, "stop"),
                          ({"content": "Sen", "finished": False}, "length"), ([], "stop")):  # fmt: skip
        out = answer(FakePredictor(reply), body, {})
        assert out["choices"][0]["finish_reason"] == finish
        assert out["usage"] == {"prompt_tokens": 12, "completion_tokens": 5, "total_tokens": 17}
    # A call list the budget cut before its end marker: a 200 reply with the raw turn, not a 400.
    cut = {"error": "no <|end|> within 5 tokens; unterminated", "raw": '<|call|>[{"na'}
    out = answer(FakePredictor(cut, cut=True), body, {})
    choice = out["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] == '<|call|>[{"na'
    assert "tool_calls" not in choice["message"] and out["usage"]["completion_tokens"] == 5
    assert answer(FakePredictor(cut), body, {})["error"]["message"] == cut["error"]  # unreadable, not cut: a 400
    # The table shape keeps its error (it has no finish reason).
    table = answer(FakePredictor(cut, cut=True), pd.DataFrame({"query": ["x"], "tools": [json.dumps([TOOL])]}), {})
    assert table["error"][0].startswith("no <|end|> within 5 tokens")


def test_protocol_fields_are_honoured_or_refused_by_name() -> None:
    fake = FakePredictor({"content": "ok", "finished": True})
    body = {"messages": CONVERSATION, "tools": [TOOL]}
    accepted = [
        ({}, None, ()),
        ({"max_tokens": 7}, 7, ()),
        ({"max_completion_tokens": 9}, 9, ()),
        ({"max_tokens": 7, "max_completion_tokens": 9}, 7, ()),  # both: the smaller
        ({"max_tokens": 7.0}, 7, ()),
        ({"stop": "\n"}, None, ("\n",)),
        ({"stop": ["a", "b"]}, None, ("a", "b")),
        ({"temperature": 0, "top_p": 0.9, "seed": 7, "n": 1, "presence_penalty": 0, "logprobs": False}, None, ()),
        ({"temperature": 0.001}, None, ()),  # a harness's "greedy"
    ]
    for extra, budget, stop in accepted:
        out = answer(fake, {**body, **extra}, {})
        assert "error" not in out, (extra, out)
        assert fake.seen[-1][0] == [Request(messages=CONVERSATION, tools=[TOOL], mode="auto", max_tokens=budget,
                                            stop=stop)]  # fmt: skip
    seen = len(fake.seen)
    refused = [
        ({"max_tokens": 0}, "max_tokens", "at least 1"),
        ({"max_completion_tokens": -3}, "max_completion_tokens", "at least 1"),
        ({"max_tokens": "5"}, "max_tokens", "an integer"),
        ({"max_tokens": 2.5}, "max_tokens", "an integer"),
        ({"n": 2}, "n", "greedy"),
        ({"n": 0}, "n", "at least 1"),
        ({"temperature": 0.7}, "temperature", "decodes greedily"),
        ({"temperature": "hot"}, "temperature", "a number"),
        ({"top_p": 0}, "top_p", "(0, 1]"),
        ({"seed": "x"}, "seed", "an integer"),
        ({"presence_penalty": 0.5}, "presence_penalty", "penalties"),
        ({"frequency_penalty": 1}, "frequency_penalty", "penalties"),
        ({"logprobs": True}, "logprobs", "log-probabilities"),
        ({"stop": ["a"] * 5}, "stop", "at most 4"),
        ({"stop": [""]}, "stop", "non-empty"),
        ({"stop": 3}, "stop", "non-empty"),
    ]
    for extra, param, words in refused:
        err = answer(fake, {**body, **extra}, {})["error"]
        assert err["type"] == "invalid_request_error" and err["param"] == param and words in err["message"], extra
    assert len(fake.seen) == seen  # refused before the model


def test_a_streamed_reply_ends_with_its_usage_when_asked() -> None:
    from needle.serve.requests import ParamError
    from needle.serve.stream import chunks, include_usage

    out = answer(FakePredictor([CALL]), {"messages": CONVERSATION, "tools": [TOOL]}, {})
    plain = list(chunks(out))
    assert all("usage" not in p for p in plain) and plain[-1]["choices"][0]["finish_reason"] == "tool_calls"
    parts = list(chunks(out, include_usage({"stream_options": {"include_usage": True}})))
    assert parts[:-1] == [{**p, "usage": None} for p in plain]  # the same chunks, each with usage null
    assert parts[-1]["choices"] == [] and parts[-1]["usage"] == out["usage"]
    assert include_usage({}) is False and include_usage({"stream_options": {}}) is False
    for bad in ({"stream_options": "yes"}, {"stream_options": {"include_usage": "yes"}}):
        with pytest.raises(ParamError) as err:
            include_usage(bad)
        assert err.value.param == "stream_options"
