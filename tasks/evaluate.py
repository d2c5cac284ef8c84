"""Prefect task: evaluate the base and the tuned model on the test split and compare them."""

import json
from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from needle.config import EvalConfig


@task(name="evaluate", cache_policy=NO_CACHE)
def evaluate(
    base_model_dir: str, tuned_model_dir: str, prepared_dir: str, eval_cfg: EvalConfig, out_dir: str
) -> dict[str, Any]:
    """Score both models' tool calls; write per-model reports and comparison.json under out_dir."""
    from needle.data.prepare import PreparedData
    from needle.eval.evaluate import evaluate_model
    from needle.eval.report import compare, summary_of, write_report
    from needle.model.io import load_model

    split = PreparedData.load(prepared_dir).splits["test"]
    out = Path(out_dir)
    results = {}
    for name, model_dir in (("base", base_model_dir), ("tuned", tuned_model_dir)):
        results[name] = evaluate_model(load_model(model_dir), split, eval_cfg)
        write_report(results[name], out / name)
    comparison = compare(results["base"], results["tuned"])
    (out / "comparison.json").write_text(json.dumps(comparison, indent=2, sort_keys=True) + "\n")
    return {
        "report_dir": str(out),
        "comparison": comparison,
        "base": summary_of(results["base"]),
        "tuned": summary_of(results["tuned"]),
    }
