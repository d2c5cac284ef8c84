"""Ask an exported model for tool calls, and the entry points of `needle predict` / `needle evaluate`.

``predict(model, tools, queries, cfg)`` renders each query with the tools in the model's chat
format (``needle.data.chat.format_for``: needle's template, or a pretrained model's own Jinja
template), decodes greedily until one of the tokenizer's stop ids and returns, per query, the parsed call list or an error object
``{"error": reason, "raw": generated text}`` when the output is malformed.

    needle predict runs/tuned/model --tools tools.json --query "turn on the kitchen lights"
    echo "set a timer for 5 minutes" | needle predict runs/tuned/model --tools tools.json
    needle evaluate runs/tuned/model data/sample/new.jsonl --max-rows 200 --out runs/tuned/eval

Decoding is constrained by default (needle/eval/constrain.py: only calls to the offered tools
that satisfy their schemas, or ``[]``); ``constrained=False`` (``needle predict --free``)
decodes freely. ``run_predict_cli`` prints one compact JSON line per query on stdout;
``run_evaluate_cli`` prints free and constrained metrics side by side and writes the report
(needle/eval/report.py). Both return the exit code.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from needle.config import EvalConfig
from needle.data.bounds import loads_bounded
from needle.data.load import read_rows
from needle.data.render import compact_json
from needle.errors import NeedleError
from needle.eval.evaluate import evaluate_model, resolve_model
from needle.eval.report import format_table, side_by_side, write_report
from needle.model.factory import LoadedModel
from needle.registry import is_registry_uri
from needle.serve.engine import Prediction, Predictor, checked_tools
from needle.serve.pyfunc import local_model_dir


def predict(
    model_dir: str | Path | LoadedModel, tools: list[dict[str, Any]], queries: list[str], cfg: EvalConfig | None = None,
    constrained: bool = True,
) -> list[Prediction]:  # fmt: skip
    """The parsed calls of each query, or ``{"error", "raw"}`` for a malformed or over-long one.

    ``tools`` is validated like a data row's tools (xLAM parameter maps are accepted), so a bad
    tools file fails here with the reason instead of producing a confusing prompt.
    """
    if not queries:
        return []
    checked_tools(tools)
    for i, query in enumerate(queries):
        if not isinstance(query, str) or not query.strip():
            raise ValueError(f"query {i + 1} is empty")
    predictor = Predictor(resolve_model(model_dir), cfg)
    return predictor.predict([(q, tools) for q in queries], constrained=constrained)


def read_tools(tools_path: str | Path) -> list[dict[str, Any]]:
    """The tool list in a JSON file (a list, or an object with a ``tools`` list)."""
    path = Path(tools_path)
    try:
        value = loads_bounded(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{path}: no such tools file") from None
    except IsADirectoryError:
        raise ValueError(f"{path}: is a directory, not a tools file") from None
    except OSError as exc:
        raise ValueError(f"{path}: cannot read the tools file ({exc.strerror})") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}:{exc.lineno}: invalid JSON: {exc.msg}") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not valid UTF-8 (byte 0x{exc.object[exc.start]:02x} at offset {exc.start})") from None
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    if isinstance(value, dict) and "tools" in value:
        value = value["tools"]
    if not isinstance(value, list):
        raise ValueError(f"{path}: expected a JSON list of tools, got {type(value).__name__}")
    return value


def run_predict_cli(model_dir: str, tools_path: str, queries: list[str], constrained: bool = True) -> int:
    """`needle predict`: one JSON line per query on stdout; 2 on a bad tools file, query or model."""
    try:
        tools = read_tools(tools_path)
        results = predict(local_model_dir(model_dir), tools, queries, constrained=constrained)
    except (ValueError, FileNotFoundError, NeedleError) as exc:
        print(f"needle predict: {exc}", file=sys.stderr)
        return 2
    for result in results:
        print(compact_json(result), flush=True)
    return 0


def run_evaluate_cli(model_dir: str, data_source: str, out_dir: str | None, max_rows: int | None,
                     constrained: bool = True) -> int:  # fmt: skip
    """`needle evaluate`: read rows, evaluate, print the metrics table, write the report.

    ``model_dir`` may be a ``models:/`` registry URI. ``out_dir`` defaults to
    ``<model_dir>/../eval`` (``./eval`` for a registry URI). Returns 2 (reason on stderr) on bad data or
    a missing or mismatched model.
    """
    try:
        rows, _ = read_rows(data_source, on_error="fail")
        local_dir = local_model_dir(model_dir)
        result = evaluate_model(local_dir, rows, EvalConfig(max_rows=max_rows, constrained=constrained))
    except (FileNotFoundError, NeedleError) as exc:
        print(f"needle evaluate: {exc}", file=sys.stderr)
        return 2
    default = Path("eval") if is_registry_uri(model_dir) else Path(local_dir).absolute().parent / "eval"
    target = Path(out_dir) if out_dir else default
    paths = write_report(result, target)
    timing = {"rows_per_s": result.rows_per_s, "tokens_per_s": result.tokens_per_s}
    print(format_table(side_by_side({**result.metrics, **timing})))
    line = f"{result.metrics['n']} rows in {result.wall_s:.1f} s ({result.rows_per_s:.1f} rows/s decoding"
    if result.metrics.get("constrained_rows_per_s") is not None:
        line += f" free, {result.metrics['constrained_rows_per_s']:.1f} rows/s constrained"
    print(line + ")")
    if result.metrics.get("constrained_skipped"):
        print(f"constrained decoding skipped: {result.metrics['constrained_skipped']}")
    for name, path in paths.items():
        print(f"{name}: {path}")
    return 0
