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
