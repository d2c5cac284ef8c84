"""Benchmark sections as tasks, runnable in this process or in a fresh subprocess.

Compile-time (cold vs warm persistent cache) and device-count sections need a fresh process
each; the others run in a subprocess too so one section's compiled programs, memory or crash
never leak into the next. The parent reads the child's JSON from a file.

    python -m bench.workers TASK spec.json out.json
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

from needle.config import EvalConfig, LoraConfig, OptimConfig, TrainConfig, model_preset
from needle.data.prepare import PreparedData
from needle.hardware import enable_compilation_cache
from needle.tracking.mlflow_tracker import MlflowTracker

from bench import fixtures


def _inputs(spec: dict[str, Any]) -> tuple[Path, Any, Any]:
    jsonl = fixtures.ensure_jsonl(spec.get("rows"))
    tok = fixtures.load_tokenizer(jsonl, spec.get("vocab_size", 1024))
    prepared = fixtures.prepare(jsonl, tok, val_fraction=spec.get("val_fraction", 0.1),
                                test_fraction=spec.get("test_fraction", 0.1))
    return jsonl, tok, prepared


def task_peak(spec: dict[str, Any]) -> dict[str, Any]:
    from bench.peak import measure_peaks

    return measure_peaks(quick=spec.get("quick", False))


def task_train(spec: dict[str, Any]) -> dict[str, Any]:
    from bench.steps import measure_train

    _, tok, prepared = _inputs(spec)
    return measure_train(spec["preset"], spec["mode"], prepared, tok, steps=spec.get("steps", 20),
                         batch_size=spec.get("batch_size", 16), warmup=spec.get("warmup", 3),
                         packing=spec.get("packing", True))


def task_compile(spec: dict[str, Any]) -> dict[str, Any]:
    """Time to the first finished step with the persistent compilation cache at ``cache_dir``."""
    import jax
    import psutil

    # lazy: jax loads only after main() has set JAX_PLATFORMS (a section's XLA_FLAGS come from bench.run)
    from needle.train.programs import StepPrograms
    from needle.train.step import train_step

    from bench.steps import build_state, make_plan

    # As the library's loop does: the persistent XLA cache, one program per shape.
    enable_compilation_cache(spec["cache_dir"])
    _, tok, prepared = _inputs(spec)
    state, model_cfg = build_state(spec["preset"], spec["mode"], tok, 10, spec.get("batch_size", 16))
    plan = make_plan(prepared, tok, model_cfg, spec["mode"], spec.get("batch_size", 16))
    batch = plan.batch(0)
    step_fn = StepPrograms(train_step, donate=True)
    t0 = time.perf_counter()
    state, metrics = step_fn(state, batch)
    jax.block_until_ready(metrics)
    first = time.perf_counter() - t0
    since_start = time.time() - psutil.Process().create_time()
    # Later steps of a packed plan reuse the one program.
    for i in range(1, 4):
        state, metrics = step_fn(state, plan.batch(i))
    jax.block_until_ready(metrics)
    return {"first_step_s": first, "process_to_first_step_s": since_start, "programs": dict(step_fn.stats)}


def task_devices(spec: dict[str, Any]) -> dict[str, Any]:
    """The library loop on a data-parallel mesh over every (virtual) device of this process."""
    # lazy, as in task_compile
    import jax
    from needle.train.loop import train
    from needle.train.sharding import make_mesh

    from bench.steps import build_state, make_plan

    _, tok, prepared = _inputs(spec)
    steps, batch = spec.get("steps", 12), spec.get("batch_size", 16)
    state, model_cfg = build_state(spec["preset"], spec["mode"], tok, steps, batch)
    plan = make_plan(prepared, tok, model_cfg, spec["mode"], batch)
    cfg = TrainConfig(mode=spec["mode"], steps=steps, batch_size=batch, log_every=max(1, steps // 3),
                      compilation_cache_dir=None)
    result = train(state, plan, cfg, mesh=make_mesh(), progress=False)
    return {"devices": jax.device_count(), "tokens_per_s": result.tokens_per_s,
            "loss": result.train_loss, "wall_s": result.wall_s, "steps": steps}


def task_needle_style(spec: dict[str, Any]) -> dict[str, Any]:
    from bench.needle_style import run_needle_style

    _, tok, prepared = _inputs(spec)
    return run_needle_style(spec["preset"], prepared, tok, epochs=spec.get("epochs", 1),
                            max_steps=spec.get("max_steps"))


def task_data_eval(spec: dict[str, Any]) -> dict[str, Any]:
    """Dataset preparation cold and from its saved copy; decode throughput of evaluation."""
    # lazy, as in task_compile
    from needle.eval.evaluate import evaluate_model

    jsonl = fixtures.ensure_jsonl(spec.get("rows"))
    tok = fixtures.load_tokenizer(jsonl, spec.get("vocab_size", 1024))
    t0 = time.perf_counter()
    prepared = fixtures.prepare(jsonl, tok)
    cold = time.perf_counter() - t0
    n = sum(len(s) for s in prepared.splits.values())
    with tempfile.TemporaryDirectory() as tmp:
        prepared.save(tmp)
        t0 = time.perf_counter()
        again = PreparedData.load(tmp)
        _ = [len(s) for s in again.splits.values()]
        cached = time.perf_counter() - t0
    base = fixtures.ensure_base(spec["preset"], tok)
    rows = spec.get("eval_rows", 32)
    res = evaluate_model(str(base), prepared.splits["test"], EvalConfig(max_rows=rows, max_new_tokens=spec.get("max_new_tokens", 48)))
    return {"rows": n, "prep_cold_s": cold, "prep_cold_examples_per_s": n / cold,
            "prep_cached_s": cached, "prep_cached_examples_per_s": n / cached,
            "eval_rows": min(rows, len(prepared.splits["test"])), "eval_wall_s": res.wall_s,
            "eval_decode_tokens_per_s": res.tokens_per_s, "eval_rows_per_s": res.rows_per_s}


def task_library_run(spec: dict[str, Any]) -> dict[str, Any]:
    """Bare-library whole run on the cactus comparison's rows: prepare, train, export, evaluate."""
    # lazy, as in task_compile
    from needle.eval.evaluate import evaluate_model
    from needle.train.run import run_training

    jsonl = fixtures.ensure_jsonl(spec.get("rows"))
    tok = fixtures.load_tokenizer(jsonl, spec.get("vocab_size", 1024))
    base = fixtures.ensure_base(spec["preset"], tok)
    t0 = time.perf_counter()
    prepared = fixtures.prepare(jsonl, tok, val_fraction=spec.get("val_fraction", 0.1), test_fraction=0.0)
    train_cfg = TrainConfig(mode="lora", steps=spec["steps"], batch_size=spec.get("batch_size", 16),
                            log_every=max(1, spec["steps"] // 4), checkpoint_every=10**6, compilation_cache_dir=None)
    with tempfile.TemporaryDirectory() as out:
        result = run_training(prepared, tok, model_preset(spec["preset"]), train_cfg, OptimConfig(lr=1e-4),
                              LoraConfig(rank=spec.get("lora_rank", 16)), base_model_dir=str(base), out_dir=out)
        t_train = time.perf_counter() - t0
        ev = evaluate_model(result.model_dir, prepared.splits["val"],
                            EvalConfig(max_rows=spec.get("eval_rows"), max_new_tokens=96))
    wall = time.perf_counter() - t0
    return {"train_s": t_train, "eval_s": ev.wall_s, "wall_s": wall, "steps": spec["steps"],
            "tokens_per_s": result.tokens_per_s, "eval_rows": len(ev.examples), "loss": result.train_loss}


def task_mlflow(spec: dict[str, Any]) -> dict[str, Any]:
    """Time MlflowTracker calls of a simulated run (metrics every log_every steps) on a temp sqlite store."""
    steps, every = spec.get("steps", 200), spec.get("log_every", 10)
    with tempfile.TemporaryDirectory() as tmp:
        uri = f"sqlite:///{tmp}/mlflow.db"
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=uri)
        run = client.create_run(client.create_experiment("bench", artifact_location=f"{tmp}/art"))
        tracker = MlflowTracker(run.info.run_id, uri)
        t0 = time.perf_counter()
        for step in range(every, steps + 1, every):
            tracker.log_metrics({"loss": 1.0 / step, "grad_norm": 0.5, "lr": 1e-3, "tokens_per_s": 4000.0,
                                 "step_time_s": 0.5}, step=step)
        tracker.finish("FINISHED")
        spent = time.perf_counter() - t0
    step_s = spec["step_s"]
    return {"steps": steps, "log_every": every, "logging_s": spent, "step_s": step_s,
            "share_of_step_time": spent / (steps * step_s)}


TASKS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "peak": task_peak, "train": task_train, "compile": task_compile, "devices": task_devices,
    "needle_style": task_needle_style, "data_eval": task_data_eval, "library_run": task_library_run,
    "mlflow": task_mlflow,
}


def main() -> int:
    task, spec_path, out_path = sys.argv[1], sys.argv[2], sys.argv[3]
    spec = json.loads(Path(spec_path).read_text())
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    try:
        result = {"ok": True, **TASKS[task](spec)}
    except Exception as exc:  # recorded as data: one failed section must not stop the benchmark
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
    Path(out_path).write_text(json.dumps(result, indent=2, default=str))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
