"""Write an evaluation to disk and compare two of them.

``write_report(result, out_dir)`` writes ``metrics.json`` (the metrics plus timing),
``examples.jsonl`` (one object per row) and ``examples.csv`` (the same, flags as columns), and
for a constrained decode (``EvalResult.constrained_examples``) ``examples_constrained.jsonl``/``.csv``.
A comparison lists the ``constrained_*`` metrics beside the free ones (needle/eval/evaluate.py).
``compare(before, after)`` lines up the numeric metrics of a base and a tuned model, and
``loggable_metrics`` gives the numeric ones for ``Tracker.log_metrics`` (None dropped), and
``format_table`` renders either a metrics dict or a comparison as a plain pipe table that reads
well in a terminal and pastes into a Markdown README. ``side_by_side`` sets one model's free and
constrained metrics in two columns (`needle evaluate`); ``before_after`` does it for base and
tuned of a comparison (what `needle finetune` prints at the end).

    from needle.eval.report import before_after, compare, format_table
    print(format_table(before_after(compare(base_result, tuned_result))))
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from needle.eval.evaluate import EvalResult

TIMING_KEYS = ("wall_s", "tokens_per_s", "rows_per_s")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def summary_of(result: EvalResult) -> dict[str, Any]:
    """The metrics of ``result`` with its timing, as one flat JSON-ready dict."""
    return {**result.metrics, **{k: getattr(result, k) for k in TIMING_KEYS}}


def _csv_value(value: Any) -> Any:
    # Nested values (lists, dicts) go in as JSON so the CSV stays one row per example.
    return value if value is None or isinstance(value, (str, int, float)) else json.dumps(value)


def loggable_metrics(result: EvalResult) -> dict[str, float]:
    """The numeric metrics and timing as floats, undefined (None) ones left out: for a tracker."""
    return {k: float(v) for k, v in summary_of(result).items() if _is_number(v)}


def write_report(result: EvalResult, out_dir: str | Path) -> dict[str, Path]:
    """Write metrics.json, examples.jsonl and examples.csv under ``out_dir``; return their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {
        "metrics": out / "metrics.json",
        "examples_jsonl": out / "examples.jsonl",
        "examples_csv": out / "examples.csv",
    }
    paths["metrics"].write_text(json.dumps(summary_of(result), indent=2, sort_keys=True) + "\n", encoding="utf-8")
    _write_examples(result.examples, paths["examples_jsonl"], paths["examples_csv"])
    if result.constrained_examples is not None:
        paths["examples_constrained_jsonl"] = out / "examples_constrained.jsonl"
        paths["examples_constrained_csv"] = out / "examples_constrained.csv"
        _write_examples(result.constrained_examples, paths["examples_constrained_jsonl"],
                        paths["examples_constrained_csv"])  # fmt: skip
    return paths


def _write_examples(examples: Sequence[dict[str, Any]], jsonl: Path, csv_path: Path) -> None:
    with jsonl.open("w", encoding="utf-8") as f:
        for ex in examples:
            f.write(json.dumps(ex, ensure_ascii=False) + "\n")
    columns: list[str] = []
    for ex in examples:
        columns.extend(k for k in ex if k not in columns)
    with csv_path.open("w", encoding="utf-8", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        for ex in examples:
            writer.writerow({k: _csv_value(v) for k, v in ex.items()})


def compare(before: EvalResult, after: EvalResult) -> dict[str, dict[str, Any]]:
    """``{metric: {"base", "tuned", "delta"}}`` for every numeric metric either result has.

    ``delta`` is tuned - base, or None when either side is missing or None.
    """
    base, tuned = summary_of(before), summary_of(after)
    table: dict[str, dict[str, Any]] = {}
    for key in [*base, *(k for k in tuned if k not in base)]:
        b, t = base.get(key), tuned.get(key)
        if not all(_is_number(v) or v is None for v in (b, t)):
            continue  # text or nested values are not metrics to compare
        delta = t - b if _is_number(b) and _is_number(t) else None
        table[key] = {"base": b, "tuned": t, "delta": delta}
    return table


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        return f"{value:.4f}" if abs(value) < 1000 else f"{value:.1f}"
    return str(value)


def format_table(table: Mapping[str, Any], *, columns: Sequence[str] | None = None) -> str:
    """A pipe table: ``metric | value`` for a flat dict, ``metric | <columns>`` for a comparison."""
    nested = any(isinstance(v, Mapping) for v in table.values())
    if nested:
        cols = list(columns or next(v for v in table.values() if isinstance(v, Mapping)).keys())
        rows = [[key, *(_cell(v.get(c)) for c in cols)] for key, v in table.items() if isinstance(v, Mapping)]
    else:
        cols = ["value"]
        rows = [[key, _cell(v)] for key, v in table.items() if not isinstance(v, (list, dict))]
    header = ["metric", *cols]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        first = cells[0].ljust(widths[0])
        rest = (c.rjust(w) for c, w in zip(cells[1:], widths[1:]))
        return "| " + " | ".join([first, *rest]) + " |"

    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(header), sep, *(line(r) for r in rows)])


def side_by_side(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """``{metric: {"free", "constrained"}}`` when there are ``constrained_*`` metrics, else ``metrics``."""
    prefix = "constrained_"
    if not any(k.startswith(prefix) and k != "constrained_skipped" for k in metrics):
        return {k: v for k, v in metrics.items() if k != "constrained_skipped"}
    table = {k: {"free": v, "constrained": metrics.get(prefix + k, v if k.startswith("n") else None)}
             for k, v in metrics.items() if not k.startswith(prefix)}  # fmt: skip
    for k, v in metrics.items():
        if k.startswith(prefix) and k[len(prefix):] not in table and isinstance(v, (int, float)):
            table[k[len(prefix):]] = {"free": None, "constrained": v}
    return table


def before_after(comparison: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """A comparison (``compare``) as ``{metric: {"base", "tuned", "base constrained", "tuned constrained"}}``:
    each side through ``side_by_side``; without constrained metrics, ``{metric: {"base", "tuned"}}``."""
    sides = {side: side_by_side({k: row.get(side) for k, row in comparison.items()}) for side in ("base", "tuned")}
    table: dict[str, dict[str, Any]] = {}
    for side, metrics in sides.items():
        for key, value in metrics.items():
            row = table.setdefault(key, {})
            if isinstance(value, Mapping):
                row[side] = value.get("free")
                row[f"{side} constrained"] = value.get("constrained")
            else:
                row[side] = value
    order = ("base", "tuned", "base constrained", "tuned constrained")
    return {k: {c: row.get(c) for c in order if any(c in r for r in table.values())} for k, row in table.items()}
