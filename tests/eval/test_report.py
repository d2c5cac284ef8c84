"""write_report files, compare deltas and the plain table."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from needle.eval.evaluate import EvalResult
from needle.eval.report import compare, format_table, loggable_metrics, write_report


def _result(exact: float, offtopic: float | None) -> EvalResult:
    examples = [
        {"query": "a, \"quoted\"\nline", "expected": "[]", "predicted": "[]", "exact": True, "tool_ok": None},
        {"query": "b", "expected": "[{}]", "predicted": "junk", "exact": False, "tool_ok": False, "extra": [1, 2]},
    ]
    metrics = {"n": 2, "exact_match": exact, "offtopic_accuracy": offtopic, "val_loss": None}
    return EvalResult(metrics=metrics, examples=examples, wall_s=2.0, tokens_per_s=100.0, rows_per_s=1.0)


def test_write_report_round_trips(tmp_path: Path) -> None:
    result = _result(0.5, None)
    paths = write_report(result, tmp_path / "out")
    metrics = json.loads(paths["metrics"].read_text())
    assert metrics["exact_match"] == 0.5 and metrics["wall_s"] == 2.0 and metrics["offtopic_accuracy"] is None
    lines = [json.loads(x) for x in paths["examples_jsonl"].read_text().splitlines()]
    assert lines == result.examples
    with paths["examples_csv"].open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["query"] for r in rows] == ["a, \"quoted\"\nline", "b"]
    assert rows[1]["extra"] == "[1, 2]" and rows[0]["extra"] == ""


def test_compare_and_table() -> None:
    table = compare(_result(0.25, None), _result(0.75, 1.0))
    assert table["exact_match"] == {"base": 0.25, "tuned": 0.75, "delta": 0.5}
    assert table["offtopic_accuracy"] == {"base": None, "tuned": 1.0, "delta": None}
    assert table["rows_per_s"]["delta"] == 0.0 and "val_loss" in table
    text = format_table(table)
    lines = text.splitlines()
    assert [c.strip() for c in lines[0].split("|")[1:-1]] == ["metric", "base", "tuned", "delta"]
    cells = {c[0]: c[1:] for c in ([x.strip() for x in line.split("|")[1:-1]] for line in lines[2:])}
    assert cells["exact_match"] == ["0.2500", "0.7500", "0.5000"]
    assert cells["offtopic_accuracy"] == ["-", "1.0000", "-"]
    assert cells["tokens_per_s"] == ["100.0000", "100.0000", "0.0000"]
    assert len({len(line) for line in lines}) == 1  # aligned columns
    flat = format_table({"n": 2, "exact_match": 0.5, "per_example": [1]})
    assert "per_example" not in flat and "| n           |      2 |" in flat.splitlines()


def test_loggable_metrics_drops_undefined_values() -> None:
    logged = loggable_metrics(_result(0.5, None))
    assert logged == {"n": 2.0, "exact_match": 0.5, "wall_s": 2.0, "tokens_per_s": 100.0, "rows_per_s": 1.0}


def test_before_after_sets_base_and_tuned_free_and_constrained_side_by_side() -> None:
    from needle.eval.report import before_after

    base = EvalResult(metrics={"n": 2, "exact_match": 0.25, "constrained_exact_match": 0.5,
                               "constrained_skipped": None}, examples=[], wall_s=2.0, tokens_per_s=10.0, rows_per_s=1.0)
    tuned = EvalResult(metrics={"n": 2, "exact_match": 0.75, "constrained_exact_match": 1.0,
                                "constrained_skipped": None}, examples=[], wall_s=1.0, tokens_per_s=20.0, rows_per_s=2.0)
    table = before_after(compare(base, tuned))
    assert table["exact_match"] == {"base": 0.25, "tuned": 0.75, "base constrained": 0.5, "tuned constrained": 1.0}
    assert table["n"]["tuned constrained"] == 2 and "constrained_exact_match" not in table
    header = format_table(table).splitlines()[0]
    assert [c.strip() for c in header.split("|")[1:-1]] == ["metric", "base", "tuned", "base constrained",
                                                            "tuned constrained"]
    free_only = before_after(compare(_result(0.25, None), _result(0.75, 1.0)))
    assert free_only["exact_match"] == {"base": 0.25, "tuned": 0.75}
