"""Conversation rows (issue 21, item 1): the OpenAI ``messages`` layout, validated with file:line
and the message index; a query/answers row is the two-message conversation it always was.

    JAX_PLATFORMS=cpu .venv/bin/python -m pytest -q tests/data/test_conversation.py
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from needle.data.conversation import row_messages
from needle.data.load import load_source, validate_source
from needle.data.schema import parse_row, row_to_dict
from needle.errors import DataError

WEATHER = {"name": "get_weather", "description": "Current weather",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}  # fmt: skip


def _call(cid: str, city: Any = "Oslo", name: str = "get_weather") -> dict[str, Any]:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": json.dumps({"city": city})}}


GOOD = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [_call("c1")]},
    {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 3}'},
    {"role": "assistant", "content": [{"type": "text", "text": "It is 3 degrees."}]},
]
USER, CALL, RESULT, TEXT = GOOD[1], GOOD[2], GOOD[3], {"role": "assistant", "content": "It is 3 degrees."}

# kind -> (messages, the message index named, words of the reason)
BAD: dict[str, tuple[list[Any], str, str]] = {
    "empty": ([], "'messages' is empty", "empty"),
    "assistant first": ([TEXT], "messages[0] (assistant)", "cannot come first"),
    "system late": ([USER, TEXT, {"role": "system", "content": "x"}, TEXT], "messages[2] (system)", "out of order"),
    "two assistants": ([USER, TEXT, TEXT], "messages[2] (assistant)", "out of order"),
    "unknown role": ([USER, {"role": "robot", "content": "x"}], "messages[1]", "has role 'robot'"),
    "undeclared tool": ([USER, {"role": "assistant", "tool_calls": [_call("c1", name="get_time")]}],
                        "messages[1] (assistant) tool_calls[0]", "undeclared tool 'get_time'"),
    "bad arguments": ([USER, {"role": "assistant", "tool_calls": [_call("c1", city=3)]}],
                      "messages[1] (assistant) tool_calls[0]", "argument 'city'"),
    "unknown call id": ([USER, CALL, {"role": "tool", "tool_call_id": "c9", "content": "x"}, TEXT],
                        "messages[2] (tool)", "'c9' answers no earlier call"),
    "answered twice": ([USER, CALL, RESULT, RESULT, TEXT], "messages[3] (tool)", "'c1' was already answered"),
    "result without call": ([USER, RESULT, TEXT], "messages[1] (tool)", "out of order"),
    "unanswered call": ([USER, {"role": "assistant", "tool_calls": [_call("c1"), _call("c2", "Rome")]}, RESULT, TEXT],
                        "messages[3] (assistant)", "c2 of the turn before have no tool result"),
    "ends with result": ([USER, CALL, RESULT], "messages[2] (tool)", "must end with an assistant turn"),
    "empty assistant": ([USER, {"role": "assistant", "content": ""}], "messages[1] (assistant)", "neither"),
    "empty user": ([{"role": "user", "content": " "}, TEXT], "messages[0] (user)", "non-empty"),
    "duplicate id": ([USER, CALL, RESULT, {"role": "assistant", "tool_calls": [_call("c1")]}],
                     "messages[3] (assistant) tool_calls[0]", "used twice"),
}  # fmt: skip


def test_a_conversation_validates_and_reads_back_unchanged() -> None:
    row = parse_row({"messages": GOOD, "tools": [{"type": "function", "function": WEATHER}]}, "f.jsonl:1")
    assert row.tools == [WEATHER]  # OpenAI's function form unwrapped
    assert row.messages[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}  # JSON string decoded
    assert row.messages[3] == {"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": '{"temp": 3}'}
    assert row.messages[4] == TEXT  # text parts joined; no tool_calls key on a text turn
    assert (row.query, row.answers, row.system) == ("Weather in Oslo?", [], "Be brief.")  # the last turns
    assert parse_row(row_to_dict(row), "f.jsonl:1") == row


def test_a_query_answers_row_is_the_two_message_conversation() -> None:
    record = {"query": "Weather in Oslo?", "tools": [WEATHER], "answers": [{"name": "get_weather", "arguments": {"city": "Oslo"}}]}
    row = parse_row(record, "f:1")
    as_conversation = parse_row({"messages": row_messages(row), "tools": [WEATHER]}, "f:1")
    assert row.messages is None and row_messages(as_conversation) == row_messages(row)
    assert (as_conversation.query, as_conversation.answers) == (row.query, row.answers)
    off_topic = parse_row({**record, "answers": []}, "f:1")
    assert row_messages(off_topic)[-1] == {"role": "assistant", "content": None, "tool_calls": []}
    assert parse_row({"messages": row_messages(off_topic), "tools": [WEATHER]}, "f:1").answers == []


def test_both_layouts_in_one_row_are_refused() -> None:
    with pytest.raises(ValueError, match="either 'messages'"):
        parse_row({"messages": GOOD, "tools": [WEATHER], "query": "x", "answers": []}, "f:1")


@pytest.mark.parametrize("kind", list(BAD))
def test_each_bad_conversation_is_named_by_file_line_and_message(kind: str, write_jsonl: Callable[..., Path]) -> None:
    messages, where, why = BAD[kind]
    good = {"messages": GOOD, "tools": [WEATHER]}
    path = write_jsonl([good, {"messages": messages, "tools": [WEATHER]}, good])
    report = validate_source(str(path))
    assert not report.ok and report.n_rows == 2 and len(report.issues) == 1
    text = str(report.issues[0])
    assert text.startswith(f"{path}:2: ") and where in text and why in text, text
    with pytest.raises(DataError, match=":2: "):
        load_source(str(path))  # fail: nothing goes on to be trained
    kept = load_source(str(path), on_error="drop")  # drop: the good rows, the issue reported
    assert len(kept.rows) == 2 and kept.rows[0].messages is not None and len(kept.issues) == 1


def test_conversations_survive_the_datasets_round_trip(write_jsonl: Callable[..., Path]) -> None:
    single = {"query": "Weather in Rome?", "tools": [WEATHER], "answers": [{"name": "get_weather", "arguments": {"city": "Rome"}}]}
    path = write_jsonl([{"messages": GOOD, "tools": [WEATHER]}, single])
    rows = load_source(str(path)).rows  # through a datasets.Dataset of string columns
    assert rows[0] == parse_row({"messages": GOOD, "tools": [WEATHER]}, f"{path}:1")
    assert rows[1] == parse_row(single, f"{path}:2") and rows[1].messages is None


def test_cli_refuses_a_bad_conversation_naming_the_message(write_jsonl: Callable[..., Path], tmp_path: Path,
                                                          capsys: Any) -> None:  # fmt: skip
    from needle_flows.cli import main

    messages, where, _ = BAD["unknown call id"]
    path = write_jsonl([{"messages": GOOD, "tools": [WEATHER]}, {"messages": messages, "tools": [WEATHER]}])
    assert main(["validate", str(path)]) == 1  # validate's own code for "bad rows found" (docs/data.md)
    assert f"{path}:2: {where}" in capsys.readouterr().out
    out = tmp_path / "run"
    assert main(["train", str(path), "--mode", "scratch", "--preset", "tiny", "--steps", "1", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{path}:2: {where}" in err and "Traceback" not in err
    assert not any(out.rglob("*.safetensors")) if out.exists() else True  # nothing trained
    ok = write_jsonl([{"messages": GOOD, "tools": [WEATHER]}], "ok.jsonl")
    assert main(["validate", str(ok)]) == 0


def test_conversations_prepare_in_needles_format(write_jsonl: Callable[..., Path], data_tokenizer: Any) -> None:
    from needle.config import DataConfig
    from needle.data.prepare import prepare_rows
    from needle.data.render import NativeFormat, conversation_segments

    single = {"query": "Weather in Rome?", "tools": [WEATHER], "answers": [{"name": "get_weather", "arguments": {"city": "Rome"}}]}
    row = parse_row(single, "s:1")
    fmt = NativeFormat()
    for loss_on in ("all_assistant", "last_assistant"):  # a query/answers row: today's ids and mask
        assert fmt.encode_conversation(row, data_tokenizer, 1 << 30, loss_on) == fmt.encode_example(row, data_tokenizer, 1 << 30)
    conv = parse_row({"messages": GOOD, "tools": [WEATHER]}, "c:1")
    segments = conversation_segments(conv)
    assert [t for _, t in segments] == [None, 2, None, 4]
    assert segments[1][0] == '<|call|>[{"name":"get_weather","arguments":{"city":"Oslo"}}]<|end|>'
    assert segments[3][0] == "It is 3 degrees.<|end|>"
    assert segments[2][0] == '<|tools|>{"name":"get_weather","content":"{\\"temp\\": 3}"}<|end|><|assistant|>'
    ex = fmt.encode_conversation(conv, data_tokenizer, 1 << 30)
    want = [int(t is not None) for text, t in segments for _ in data_tokenizer.encode(text)]
    assert ex.loss_mask == want
    path = write_jsonl([single, {"messages": GOOD, "tools": [WEATHER]}, single, single])
    cfg = DataConfig(source=str(path), val_fraction=0, test_fraction=0, max_len=1024)
    prepared = prepare_rows(load_source(str(path)), cfg, data_tokenizer)
    assert prepared.stats["rows"]["train"] == 4 and prepared.stats["dropped"] == 0


def test_the_sample_conversations_validate() -> None:
    # data/sample/conversations.jsonl: the loop's three shapes (answer after a result, a second
    # call after a result, an error result answered by a question), kept apart from new.jsonl so
    # the main job's data is unchanged until conversations train.
    path = Path(__file__).resolve().parents[2] / "data/sample/conversations.jsonl"
    rows = load_source(str(path)).rows
    assert len(rows) == 3 and all(r.messages is not None for r in rows)
    assert [r.messages[-1].get("tool_calls") is not None for r in rows] == [False, True, False]
