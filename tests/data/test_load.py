"""Loading JSONL sources: file:line issues, error policies, globs, and the datasets round trip."""

from __future__ import annotations

import json

import pytest
from data_helpers import LIGHTS, TIMER, good_row

from needle.data.load import format_validation, read_rows, resolve_files, validate_source
from needle.errors import DataError

BAD_LINES = {
    "not json": ('{"query": "x", "tools": [', "not valid JSON"),
    "missing query": (json.dumps(good_row(query=...)), "missing field 'query'"),
    "tools not a list": (json.dumps(good_row(tools="5")), "'tools' must be a list, got int"),
    "undeclared tool": (json.dumps(good_row(answers=[{"name": "fly", "arguments": {}}])), "undeclared tool 'fly'"),
    "missing required arg": (
        json.dumps(good_row(answers=[{"name": "set_timer", "arguments": {"label": "tea"}}])),
        "missing required argument 'minutes'",
    ),
    "wrong arg type": (
        json.dumps(good_row(answers=[{"name": "set_timer", "arguments": {"minutes": "five"}}])),
        "argument 'minutes': 'five' is not of type 'integer'",
    ),
    "not utf-8": (b'{"query": "caf\xe9", "tools": [], "answers": []}', "not valid UTF-8 (byte 0xe9"),
    "not an object": ("[1, 2, 3]", "must be a JSON object"),
}


@pytest.mark.parametrize("kind", sorted(BAD_LINES))
def test_each_bad_line_is_reported_with_file_and_line(write_jsonl, kind: str) -> None:
    bad, reason = BAD_LINES[kind]
    path = write_jsonl([good_row(), good_row(), bad, good_row()])
    with pytest.raises(DataError) as err:
        read_rows(str(path))
    (issue,) = err.value.issues
    assert (issue.file, issue.line) == (str(path), 3)
    assert reason in issue.reason
    assert f"{path}:3: " in str(err.value)


def test_empty_file_is_an_error(write_jsonl) -> None:
    path = write_jsonl([])
    with pytest.raises(DataError, match=f"{path}:1: file is empty"):
        read_rows(str(path))
    blank = write_jsonl(["", "  "], name="blank.jsonl")
    with pytest.raises(DataError, match="no rows"):
        read_rows(str(blank))


def test_blank_lines_are_skipped_and_line_numbers_kept(write_jsonl) -> None:
    path = write_jsonl([good_row(), "", good_row(query="second"), "   ", "nope"])
    rows, issues = read_rows(str(path), on_error="drop")
    assert [r.source for r in rows] == [f"{path}:1", f"{path}:3"]
    assert [(i.line, i.reason.split(":")[0]) for i in issues] == [(5, "not valid JSON")]


def test_drop_keeps_good_rows_and_reports_each_bad_one(write_jsonl) -> None:
    path = write_jsonl([good_row(), BAD_LINES["not json"][0], good_row(query=...), good_row()])
    rows, issues = read_rows(str(path), on_error="drop")
    assert len(rows) == 2 and [i.line for i in issues] == [2, 3]
    assert "missing field 'query'" in issues[1].reason


def test_drop_still_fails_when_nothing_is_left(write_jsonl) -> None:
    path = write_jsonl(["nope"])
    with pytest.raises(DataError):
        read_rows(str(path), on_error="drop")


def test_unknown_policy_is_rejected(write_jsonl) -> None:
    with pytest.raises(ValueError, match="on_error"):
        read_rows(str(write_jsonl([good_row()])), on_error="ignore")  # type: ignore[arg-type]


def test_glob_and_directory_expand_sorted(write_jsonl, tmp_path) -> None:
    write_jsonl([good_row(query="b")], name="b.jsonl")
    write_jsonl([good_row(query="a")], name="a.jsonl")
    rows, _ = read_rows(str(tmp_path / "*.jsonl"))
    assert [r.query for r in rows] == ["a", "b"]
    assert resolve_files(str(tmp_path)) == [str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")]


def test_missing_local_sources_are_errors_not_hub_ids(tmp_path) -> None:
    for source in (str(tmp_path / "nope.jsonl"), str(tmp_path / "*.jsonl")):
        with pytest.raises(DataError):
            resolve_files(source)
    assert resolve_files("Salesforce/xlam-function-calling-60k") is None


def test_datasets_round_trip_keeps_each_schema_as_written(write_jsonl) -> None:
    # Rows with different tool schemas: an arrow json load would add the other rows' keys as nulls.
    other = {"name": "play", "parameters": {"type": "object", "properties": {"artist": {"type": "string"}}}}
    rows_in = [good_row(), good_row(tools=[other], answers=[{"name": "play", "arguments": {"artist": "Bach"}}])]
    rows, _ = read_rows(str(write_jsonl(rows_in)))
    assert [r.tools for r in rows] == [[TIMER, LIGHTS], [other]]
    assert rows[1].answers == [{"name": "play", "arguments": {"artist": "Bach"}}]


def test_validate_source_and_format(write_jsonl) -> None:
    good = write_jsonl([good_row()] * 3, name="good.jsonl")
    report = validate_source(str(good))
    assert (report.ok, report.n_rows, report.n_files) == (True, 3, 1)
    assert format_validation(report) == "ok: 3 rows in 1 file(s)"
    bad = write_jsonl([good_row()] + ["nope"] * 25, name="bad.jsonl")
    report = validate_source(str(bad))
    assert not report.ok and report.n_rows == 1 and len(report.issues) == 25
    lines = format_validation(report).splitlines()
    assert len(lines) == 21 and lines[0].startswith(f"{bad}:2: not valid JSON")
    assert lines[-1].startswith("... 25 bad rows in total")


def test_validate_source_reports_a_missing_file(tmp_path) -> None:
    report = validate_source(str(tmp_path / "missing.jsonl"))
    assert not report.ok and "no such file" in format_validation(report)


def _tool_row(params: dict, args: dict) -> dict:
    return good_row(tools=[{"name": "f", "parameters": params}], answers=[{"name": "f", "arguments": args}])


HOSTILE_LINES = {
    "remote $ref": (json.dumps(_tool_row({"type": "object", "properties": {"x": {"$ref": "http://127.0.0.1:9/x.json"}}},
                                         {"x": 1})), "points outside the schema"),
    "backtracking pattern": (json.dumps(_tool_row({"type": "object", "properties": {"x": {"pattern": "^(a|a)+$"}}},
                                                  {"x": "a" * 40 + "!"})), "takes too long to check"),
    "backtracking patternProperties": (json.dumps(_tool_row({"type": "object", "patternProperties": {"^(a|aa)+$": {}}},
                                                            {"a" * 40 + "!": 1})), "takes too long to check"),
    "deep nesting": ("[" * 100_000 + "]" * 100_000, "nested deeper than 64 levels"),
    "deep nesting in a JSON string": (json.dumps(good_row(tools="[" * 5000 + "]" * 5000)), "nested deeper than"),
    "lone surrogate": ('{"query": "\\ud800", "tools": [], "answers": []}', "lone surrogate \\ud800"),
    "1e400": ('{"query": "x", "tools": [], "answers": [], "n": 1e400}', "1e400 is out of range"),
    "NaN": ('{"query": "x", "tools": [], "answers": [], "n": NaN}', "NaN is not allowed"),
    "Infinity": ('{"query": "x", "tools": [], "answers": [], "n": -Infinity}', "-Infinity is not allowed"),
    "5 MB row": ('{"query": "' + "a" * 5_000_000 + '", "tools": [], "answers": []}', "over the limit of 1,000,000"),
}


@pytest.mark.parametrize("kind", sorted(HOSTILE_LINES))
def test_hostile_rows_are_file_line_errors_in_seconds_without_network(write_jsonl, monkeypatch, kind: str) -> None:
    import socket
    import time

    def no_network(*args, **kwargs):
        raise AssertionError("validation opened a network connection")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    bad, reason = HOSTILE_LINES[kind]
    path = write_jsonl([good_row(), bad, good_row()])
    start = time.monotonic()
    report = validate_source(str(path))
    assert time.monotonic() - start < 5
    (issue,) = report.issues
    assert (issue.file, issue.line, report.n_rows) == (str(path), 2, 2)
    assert reason in issue.reason and len(issue.reason) < 300


def test_a_timed_out_pattern_is_refused_at_once_on_later_rows(write_jsonl) -> None:
    import time

    pattern = "^(b|b)+$"
    slow = _tool_row({"type": "object", "properties": {"x": {"pattern": pattern}}}, {"x": "b" * 40 + "!"})
    path = write_jsonl([slow] * 200)
    start = time.monotonic()
    report = validate_source(str(path))
    assert time.monotonic() - start < 5 and len(report.issues) == 200
    assert "refused" in report.issues[-1].reason


def test_bounded_checks_keep_valid_rows_as_they_were(write_jsonl) -> None:
    params = {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}$"},
                                               "x": {"$ref": "#/$defs/n"}},
              "patternProperties": {"^opt_": {"type": "integer"}}, "$defs": {"n": {"type": "number"}}}  # fmt: skip
    good = dict(_tool_row(params, {"code": "ABC", "x": 1e300, "opt_a": 2}), query="caf\u00e9 \U0001f600 [[1]]")
    (row,), _ = read_rows(str(write_jsonl([good], name="good.jsonl")))
    assert row.answers[0]["arguments"] == {"code": "ABC", "x": 1e300, "opt_a": 2}
    assert row.query == "caf\u00e9 \U0001f600 [[1]]"
    for args, reason in [({"code": "abc"}, "does not match"), ({"opt_b": "s"}, "not of type 'integer'"),
                         ({"x": "s"}, "not of type 'number'")]:
        report = validate_source(str(write_jsonl([_tool_row(params, args)], name="bad.jsonl")))
        assert reason in report.issues[0].reason
