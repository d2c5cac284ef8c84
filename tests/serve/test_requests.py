"""Request shapes of the served model, with a stand-in predictor (no model, milliseconds)."""

from __future__ import annotations

import json

import pandas as pd

from needle.serve.requests import answer

TOOL = {"name": "send_message", "parameters": {"type": "object", "properties": {"contact": {"type": "string"}}}}
CALL = {"name": "send_message", "arguments": {"contact": "Bob"}}


class FakePredictor:
    def __init__(self, reply):
        self.reply, self.seen = reply, []

    def predict(self, requests, constrained=True):
        self.seen.append((requests, constrained))
        return [self.reply] * len(requests)


def test_table_rows_get_calls_or_their_own_error() -> None:
    fake = FakePredictor([CALL])
    df = pd.DataFrame({"query": ["text Bob", "x", None], "tools": [json.dumps([TOOL]), "{bad", "[]"]})
    out = answer(fake, df, {})
    assert list(out.columns) == ["calls", "error"]
    assert json.loads(out["calls"][0]) == [CALL] and out["error"][0] is None
    assert out["calls"][1] is None and out["error"][1].startswith("tools is not valid JSON")
    assert out["error"][2] == "missing column 'query'"
    assert fake.seen == [([("text Bob", [TOOL])], True)]  # only the good row reaches the model
    answer(fake, df.iloc[:1], {"constrained": False})
    assert fake.seen[-1][1] is False


def test_openai_chat_body_answers_tool_calls() -> None:
    fake = FakePredictor([CALL])
    body = {"model": "m", "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "text Bob"}],
            "tools": [{"type": "function", "function": {**TOOL, "strict": True}}]}  # fmt: skip
    out = answer(fake, body, {})
    assert fake.seen[0][0] == [("text Bob", [TOOL])]
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
