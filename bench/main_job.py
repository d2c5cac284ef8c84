"""The main job's library stages, each timed, on whatever backend JAX finds: the accelerator's run
of ``make run`` without Prefect and MLflow (neither server runs on a TPU host without sockets).

The stages and configs are the flow's defaults for ``needle finetune data/sample/new.jsonl
--preset small --base auto`` (flows/params.py ``FinetuneParams(preset="small")``; a test checks
that they are equal): validation of the data and the gate set, an ``auto`` base trained from
scratch on data/sample/base.jsonl, the data prepared with its tokenizer, LoRA fine-tuning, and
the evaluation of base and tuned model on the test split (460 rows, 473 turns), free and
constrained. Each stage is a ``needle.pipeline`` call, as in the flow. Left out: the export, the
gate (scoring tuned and champion on the 200 gate rows) and registration.

    python -m bench.main_job [--state DIR] [--steps N] [--base-steps N] [--eval-rows N] [--out FILE]

Prints one line per stage and the comparison table's main rows; writes JSON (default
bench/results/main-job-<backend>.json). ``--state`` keeps the base, the prepared data, the tuned
model (in a folder keyed by its inputs, as the flow keys it) and JAX's compilation cache between
runs; the default, a new temporary folder, runs and compiles every stage afresh.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from needle.config import EvalConfig, LoraConfig, data_config, model_preset, training_configs
from needle.hardware import prepare_platform_env

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "data" / "sample" / "new.jsonl"
BASE_DATA = REPO / "data" / "sample" / "base.jsonl"
PRESET = "small"
ROWS = ("tool_name_accuracy", "exact_match", "valid_call_rate", "constrained_tool_name_accuracy",
        "constrained_exact_match", "constrained_valid_call_rate", "val_loss")  # fmt: skip


def job_configs(state: Path, steps: int | None, base_steps: int | None, eval_rows: int | None) -> dict[str, Any]:
    """The flow's default configs (``FinetuneParams(preset="small")``), JAX's compilation cache in ``state``."""
    # lazy: needle.pipeline loads jax, which must wait for main()'s prepare_platform_env
    from needle.pipeline import AutoBase

    cache = {"compilation_cache_dir": str(state / "jax-cache")}  # cold in a new state, as the docstring says
    model_cfg = model_preset(PRESET)
    base_train, base_optim = training_configs("scratch", steps=base_steps, train=cache)
    train_cfg, optim_cfg = training_configs("lora", steps=steps, train=cache)
    return {"auto": AutoBase(data_config(str(BASE_DATA), model_cfg, None, "fail"), model_cfg, base_train, base_optim),
            "train": train_cfg, "optim": optim_cfg, "lora": LoraConfig(), "eval": EvalConfig(max_rows=eval_rows)}  # fmt: skip


def run_stages(state: Path, steps: int | None, base_steps: int | None, eval_rows: int | None) -> dict[str, Any]:
    """The flow's stages as library calls; seconds per stage and the comparison."""
    import jax

    # lazy: jax loads only after main() has run prepare_platform_env
    from needle import pipeline
    from needle.gate import DEFAULT_GATE

    cfg = job_configs(state, steps, base_steps, eval_rows)
    times: dict[str, float] = {}
    clock = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        times[name] = round(now - clock, 2)
        clock = now

    source = pipeline.load_data(str(DATA))
    pipeline.load_data(str(REPO / DEFAULT_GATE))  # the flow validates the gate set before training, too
    lap("validate_s")
    base = pipeline.obtain_base("auto", preset=PRESET, auto=cfg["auto"], state_dir=state)
    lap("base_s")
    prepared = pipeline.prepare_data(data_config(str(DATA), base.model_cfg, None, "fail"), source,
                                     tokenizer=base.tokenizer, cache_dir=state / "prepared")  # fmt: skip
    lap("prepare_s")
    # keyed by its inputs as the flow keys it: a kept state resumes only the same run
    key = pipeline.config_digest(prepared.fingerprint, base.model_cfg, cfg["train"], cfg["optim"], cfg["lora"],
                                 base.model_dir)  # fmt: skip
    tuned = pipeline.train(prepared, base.model_cfg, cfg["train"], cfg["optim"], cfg["lora"], base=base,
                           out_dir=state / "finetune" / f"lora-{key}")  # fmt: skip
    lap("lora_s")
    report = pipeline.evaluate(base, tuned.model_dir, prepared, cfg["eval"], state / "eval" / key)
    lap("evaluate_s")
    return {"backend": jax.default_backend().lower(), "device_kind": jax.devices()[0].device_kind,
            "base_cached": base.cached, "test_rows": len(prepared.data.splits["test"]), "eval_turns": report.comparison["n"]["tuned"],
            "times": times, "total_s": round(sum(times.values()), 2), "train_loss": tuned.train_loss,
            "val_loss": tuned.val_loss, "comparison": {k: report.comparison.get(k) for k in ROWS}}  # fmt: skip


def format_result(result: dict[str, Any]) -> str:
    """Stage times, then base vs tuned for the main rows."""
    lines = [f"{result['device_kind']} ({result['backend']}): " + ", ".join(f"{k} {v:.1f}" for k, v in result["times"].items())
             + f"; total {result['total_s']:.1f} s"]  # fmt: skip
    cell = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    for key, row in result["comparison"].items():
        if row:
            lines.append(f"  {key:<32} base {cell(row['base']):>7}  tuned {cell(row['tuned']):>7}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--state", default=None, help="folder for the base, prepared data and tuned model (default: temporary)")
    ap.add_argument("--steps", type=int, default=None, help="LoRA steps (default: the mode's, as make run)")
    ap.add_argument("--base-steps", type=int, default=None, help="base steps (default: scratch's, as make run)")
    ap.add_argument("--eval-rows", type=int, default=None, help="cap on evaluated test rows (default: all)")
    ap.add_argument("--out", default=None, help="JSON file (default: bench/results/main-job-<backend>.json)")
    args = ap.parse_args(argv)
    prepare_platform_env()
    with tempfile.TemporaryDirectory(prefix="needle-main-job-") as tmp:
        result = run_stages(Path(args.state or tmp), args.steps, args.base_steps, args.eval_rows)
    result["date"] = time.strftime("%Y-%m-%d")
    out = Path(args.out or REPO / "bench" / "results" / f"main-job-{result['backend']}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(format_result(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
