"""Ask an exported model for tool calls, and the entry points of `needle predict` / `needle evaluate`.

``predict(model, tools, queries, cfg)`` renders each query with the tools in the model's chat
format (``needle.data.chat.format_for``: needle's template, or a pretrained model's own Jinja
template), decodes greedily until one of the tokenizer's stop ids and returns, per query, the parsed call list or an error object
``{"error": reason, "raw": generated text}`` when the output is malformed.

    needle predict runs/tuned/model --tools tools.json --query "turn on the kitchen lights"
    echo "set a timer for 5 minutes" | needle predict runs/tuned/model --tools tools.json
    needle evaluate runs/tuned/model data/sample/new.jsonl --max-rows 200 --out runs/tuned/eval

``run_predict_cli`` prints one compact JSON line per query on stdout; ``run_evaluate_cli`` prints
the metrics table and writes the report (needle/eval/report.py). Both return the exit code.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from needle.config import EvalConfig
from needle.data.chat import format_for
from needle.data.render import compact_json
from needle.data.schema import Row, loads_bounded, parse_row
from needle.errors import NeedleError
from needle.registry import is_registry_uri, resolve_model_dir
from needle.eval.decode import generate_detailed, prompt_budget
from needle.eval.evaluate import evaluate_model, resolve_model
from needle.eval.report import format_table, write_report
from needle.model.io import LoadedModel
from needle.model.transformer import Transformer

Prediction = list[dict[str, Any]] | dict[str, Any]


def _rows_for(tools: list[dict[str, Any]], queries: list[str]) -> list[Row]:
    """One prompt row per query, the tools validated (and normalised) once."""
    try:
        checked = parse_row({"query": "?", "tools": tools, "answers": []}, "tools").tools
    except ValueError as exc:
        raise ValueError(f"invalid tools: {exc}") from None
    for i, query in enumerate(queries):
        if not isinstance(query, str) or not query.strip():
            raise ValueError(f"query {i + 1} is empty")
    return [
        Row(query=q, tools=checked, answers=[], reasoning=None, system=None, source=f"query:{i + 1}")
        for i, q in enumerate(queries)
    ]


def predict(
    model_dir: str | Path | LoadedModel, tools: list[dict[str, Any]], queries: list[str], cfg: EvalConfig | None = None
) -> list[Prediction]:
    """The parsed calls of each query, or ``{"error", "raw"}`` for a malformed or over-long one.

    ``tools`` is validated like a data row's tools (xLAM parameter maps are accepted), so a bad
    tools file fails here with the reason instead of producing a confusing prompt.
    """
    cfg = cfg or EvalConfig()
    if not queries:
        return []
    rows = _rows_for(tools, queries)
    loaded = resolve_model(model_dir)
    tok = loaded.tokenizer
    fmt = format_for(tok)
    model = Transformer(loaded.model_cfg)
    prompts = tok.encode_batch([fmt.render_prompt(r) for r in rows])
    budget = prompt_budget(model, cfg.max_new_tokens)
    # Truncating a prompt would cut the tools or the query: refuse those queries one by one instead.
    fits = [i for i, p in enumerate(prompts) if len(p) <= budget]
    gen = generate_detailed(
        model,
        loaded.params,
        [prompts[i] for i in fits],
        max_new_tokens=cfg.max_new_tokens,
        end_id=tok.stop_ids,
        pad_id=tok.pad_id,
        batch_size=cfg.batch_size,
    )
    end_name = tok.decode([tok.end_id])
    too_long = f"at most {budget} fit with max_new_tokens={cfg.max_new_tokens}"
    out: list[Prediction] = [{"error": f"prompt has {len(p)} tokens; {too_long}", "raw": ""} for p in prompts]
    for i, ids, finished in zip(fits, gen.ids, gen.finished):
        text = tok.decode(ids)
        parsed = fmt.parse(text)
        if parsed.ok:
            out[i] = parsed.calls
        else:
            reason = parsed.error if finished else f"no {end_name} within {cfg.max_new_tokens} tokens; {parsed.error}"
            out[i] = {"error": reason, "raw": text}
    return out


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


def run_predict_cli(model_dir: str, tools_path: str, queries: list[str]) -> int:
    """`needle predict`: one JSON line per query on stdout; 2 on a bad tools file, query or model."""
    try:
        tools = read_tools(tools_path)
        results = predict(resolve_model_dir(model_dir), tools, queries)
    except (ValueError, FileNotFoundError, NeedleError) as exc:
        print(f"needle predict: {exc}", file=sys.stderr)
        return 2
    for result in results:
        print(compact_json(result), flush=True)
    return 0


def run_evaluate_cli(model_dir: str, data_source: str, out_dir: str | None, max_rows: int | None) -> int:
    """`needle evaluate`: read rows, evaluate, print the metrics table, write the report.

    ``model_dir`` may be a ``models:/`` registry URI. ``out_dir`` defaults to
    ``<model_dir>/../eval`` (``./eval`` for a registry URI). Returns 2 (reason on stderr) on bad data or
    a missing or mismatched model.
    """
    from needle.data.load import read_rows

    try:
        rows, _ = read_rows(data_source, on_error="fail")
        local_dir = resolve_model_dir(model_dir)
        result = evaluate_model(local_dir, rows, EvalConfig(max_rows=max_rows))
    except (FileNotFoundError, NeedleError) as exc:
        print(f"needle evaluate: {exc}", file=sys.stderr)
        return 2
    default = Path("eval") if is_registry_uri(model_dir) else Path(local_dir).absolute().parent / "eval"
    target = Path(out_dir) if out_dir else default
    paths = write_report(result, target)
    print(format_table(result.metrics))
    print(f"{result.metrics['n']} rows in {result.wall_s:.1f} s ({result.rows_per_s:.1f} rows/s decoding)")
    for name, path in paths.items():
        print(f"{name}: {path}")
    return 0
