"""Row validation: fields, tools, answers and argument types against each tool's schema."""

from __future__ import annotations

import json

import pytest

from needle.data.schema import Row, parse_row, row_to_dict, split_source
from data_helpers import LIGHTS, TIMER, good_row


def test_valid_row_parses_to_frozen_row() -> None:
    row = parse_row(good_row(reasoning="needs a timer", system="Be brief."), "f.jsonl:3")
    assert isinstance(row, Row)
    assert row.source == "f.jsonl:3" and row.reasoning == "needs a timer" and row.system == "Be brief."
    assert row.answers == [{"name": "set_timer", "arguments": {"minutes": 5}}]
    with pytest.raises(AttributeError):
        row.query = "x"  # type: ignore[misc]


def test_off_topic_row_has_no_answers() -> None:
    assert parse_row(good_row(answers=[]), "s:1").answers == []


def test_xlam_string_layout_is_accepted() -> None:
    obj = {
        "id": 7,
        "query": "Weather in Lima?",
        "tools": json.dumps([{"name": "weather", "description": "d",
                              "parameters": {"city": {"type": "str", "description": "c"},
                                             "unit": {"type": "str, optional", "default": "C"},
                                             "days": {"type": "int"}}}]),
        "answers": json.dumps([{"name": "weather", "arguments": {"city": "Lima", "days": 2}}]),
    }  # fmt: skip
    row = parse_row(obj, "x:1")
    params = row.tools[0]["parameters"]
    assert params["type"] == "object" and params["required"] == ["city", "days"]
    assert params["properties"]["days"]["type"] == "integer"
    assert row.answers[0]["arguments"] == {"city": "Lima", "days": 2}
    bad = dict(obj, answers=json.dumps([{"name": "weather", "arguments": {"city": "Lima", "days": "two"}}]))
    with pytest.raises(ValueError, match="'days'.*not of type 'integer'"):
        parse_row(bad, "x:1")


def test_arguments_given_as_json_string_are_decoded() -> None:
    row = parse_row(good_row(answers=[{"name": "set_timer", "arguments": '{"minutes": 3}'}]), "s:1")
    assert row.answers[0]["arguments"] == {"minutes": 3}


@pytest.mark.parametrize(
    ("row", "reason"),
    [
        ([1, 2], "row must be a JSON object, got list"),
        (good_row(query=...), "missing field 'query'"),
        (good_row(query="  "), "'query' must be a non-empty string"),
        (good_row(query=5), "'query' must be a non-empty string"),
        (good_row(tools={"a": 1}), "'tools' must be a list, got dict"),
        (good_row(tools="[not json"), "'tools' is a string but not valid JSON"),
        (good_row(answers=...), "missing field 'answers'"),
        (good_row(answers={}), "'answers' must be a list"),
        (good_row(tools=[TIMER, TIMER]), "tool name 'set_timer' is declared twice"),
        (good_row(tools=[{"description": "x"}]), "tools\\[0\\] needs a non-empty string 'name'"),
        (good_row(tools=[dict(TIMER, parameters={"type": "array"})]), "must be a JSON schema"),
        (good_row(answers=[{"name": "fly", "arguments": {}}]), "answers\\[0\\] calls undeclared tool 'fly'"),
        (good_row(answers=[{"name": "set_timer", "arguments": {}}]), "missing required argument 'minutes'"),
        (good_row(answers=[{"name": "set_timer", "arguments": {"minutes": "5"}}]),
         "argument 'minutes': '5' is not of type 'integer'"),
        (good_row(answers=[{"name": "set_timer", "arguments": [5]}]), "'arguments' must be an object"),
        (good_row(reasoning=3), "'reasoning' must be a string"),
    ],
)  # fmt: skip
def test_bad_rows_name_the_reason(row: object, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        parse_row(row, "s:1")


def test_undeclared_argument_only_rejected_when_schema_forbids_it() -> None:
    extra = [{"name": "set_timer", "arguments": {"minutes": 5, "color": "red"}}]
    assert parse_row(good_row(answers=extra), "s:1").answers == extra
    strict = dict(TIMER, parameters=dict(TIMER["parameters"], additionalProperties=False))
    with pytest.raises(ValueError, match="undeclared argument 'color'"):
        parse_row(good_row(tools=[strict, LIGHTS], answers=extra), "s:1")


def test_row_to_dict_round_trips() -> None:
    obj = good_row(system="S")
    assert row_to_dict(parse_row(obj, "s:1")) == obj


def test_split_source() -> None:
    assert split_source("dir/a:b.jsonl:12") == ("dir/a:b.jsonl", 12)
    assert split_source("no-line") == ("no-line", 0)


def test_nested_additional_properties_match_patterns_in_bounded_time() -> None:
    import time

    inner = {"type": "object", "patternProperties": {"^(c|cc)+$": {}}, "additionalProperties": False}
    tools = [{"name": "f", "parameters": {"type": "object", "properties": {"o": inner}}}]
    ok = parse_row(good_row(tools=tools, answers=[{"name": "f", "arguments": {"o": {"cc": 1}}}]), "s:1")
    assert ok.answers[0]["arguments"] == {"o": {"cc": 1}}
    with pytest.raises(ValueError, match="does not match any of the regexes"):
        parse_row(good_row(tools=tools, answers=[{"name": "f", "arguments": {"o": {"d": 1}}}]), "s:1")
    start = time.monotonic()
    with pytest.raises(ValueError, match="takes too long to check"):
        parse_row(good_row(tools=tools, answers=[{"name": "f", "arguments": {"o": {"c" * 40 + "!": 1}}}]), "s:1")
    assert time.monotonic() - start < 3


@pytest.mark.parametrize(
    "row, reason",
    [
        (good_row(answers=[{"name": "set_timer", "arguments": {"minutes": float("inf")}}]), "not a finite number"),
        (good_row(answers=[{"name": "set_timer", "arguments": {"minutes": float("nan")}}]), "not a finite number"),
        (good_row(query="timer \ud800 please"), "lone surrogate"),
        (good_row(answers=[{"name": "set_timer", "arguments": {"label": "x\udfff"}}]), "lone surrogate"),
    ],
)
def test_decoded_rows_are_checked_like_parsed_json(row: object, reason: str) -> None:
    # Hub datasets hand over struct columns already decoded: no JSON parser saw them.
    with pytest.raises(ValueError, match=reason):
        parse_row(row, "owner/name:1")
