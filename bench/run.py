"""needle's benchmark: one command, a printed table, one JSON with stable keys.

    python -m bench.run [--quick] [--skip-cactus] [--sections train,compile,...]
                        [--out bench/results/latest.json]

Sections (each in its own subprocess; a failed one is recorded, never fatal): ``peak``
(f32 matmul limit), ``train`` (small/medium x lora/full step time, tokens/s, FLOPs,
utilisation, input wait), ``compile`` (cold vs warm persistent cache), ``needle_style``,
``cactus`` (the real cactus-needle finetune_local in .cache/bench-venv), ``data_eval``,
``pipeline`` (MLflow logging share, and bench/pipeline.py: embedded flow vs bare library,
``prefect deployment run`` to first step),
``devices`` (1/2/4/8 virtual CPU devices), ``hf_load``, ``serve`` (bench/serve.py: `needle serve`
latency and throughput, table shape and the OpenAI client, constrained vs free decoding),
``memory`` (bench/memory.py: real model shapes, LoRA 4x640 and decoding, old vs new code paths:
tokens/s, share of peak, peak memory, rows/s). ``--quick`` runs peak and one tiny train config
in-process (a smoke test). Every key is documented in docs/benchmark.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from needle.config import model_preset
from needle.hardware import probe

from bench.fixtures import CACHE, REPO
from bench.report import evaluate_targets, format_table, write_result

SCHEMA_VERSION = 1
SECTIONS = ("peak", "train", "compile", "needle_style", "cactus", "data_eval", "pipeline", "devices", "hf_load", "serve",
            "memory", "needle3")
CACTUS_ROWS = 400  # rows of new.jsonl for the cactus comparison (Needle scores 10 % of them)


def run_task(task: str, spec: dict[str, Any], *, isolated: bool = True, env: dict[str, str] | None = None,
             timeout_s: float = 1800) -> dict[str, Any]:
    """Run ``bench.workers`` task in a subprocess (or here); a ``status`` key says how it went."""
    if not isolated:
        from bench.workers import TASKS

        try:
            return {"status": "ok", **TASKS[task](spec)}
        except Exception as exc:  # a failed section is data
            return {"status": "failed", "error": f"{type(exc).__name__}: {exc}"}
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        spec_path, out_path = Path(tmp, "spec.json"), Path(tmp, "out.json")
        spec_path.write_text(json.dumps(spec))
        full_env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu"), **(env or {})}
        try:
            done = subprocess.run([sys.executable, "-m", "bench.workers", task, str(spec_path), str(out_path)],
                                  cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return {"status": "failed", "error": f"{task} timed out after {timeout_s:.0f} s"}
        if not out_path.exists():
            return {"status": "failed", "error": f"{task} exited {done.returncode}: {done.stderr[-600:]}"}
        out = json.loads(out_path.read_text())
        ok = out.pop("ok", False)
        return {"status": "ok" if ok else "failed", **out}


def run_module(module: str, *args: str, timeout_s: float) -> tuple[dict[str, Any] | None, str]:
    """``python -m <module> *args --out FILE`` from the checkout: the JSON it wrote, or None and why
    (its exit code and the end of its stderr) when it wrote none."""
    name = module.rsplit(".", 1)[-1]
    with tempfile.TemporaryDirectory(prefix=f"bench-{name}-") as tmp:
        target = Path(tmp) / f"{name}.json"
        done = subprocess.run([sys.executable, "-m", module, *args, "--out", str(target)], cwd=REPO,
                              capture_output=True, text=True, timeout=timeout_s)  # fmt: skip
        if not target.exists():
            return None, f"{module} exited {done.returncode}: {done.stderr[-800:]}"
        return json.loads(target.read_text()), ""


def machine_info() -> dict[str, Any]:
    info = probe()
    return {"backend": info["backend"], "device_kind": info["device_kind"], "device_count": info["device_count"],
            "cpu_count": os.cpu_count(), "jax_version": info["jax_version"], "loadavg_start": _load()}


def _load() -> float | None:
    return round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None


def bench_train(quick: bool, peak_gflops: float | None, isolated: bool) -> dict[str, Any]:
    configs = [("tiny", "lora")] if quick else [(p, m) for p in ("small", "medium") for m in ("lora", "full")]
    out = {}
    for preset, mode in configs:
        spec = {"preset": preset, "mode": mode, "vocab_size": model_preset(preset).vocab_size,
                "rows": 64 if quick else None, "steps": 2 if quick else 12, "warmup": 1 if quick else 3}
        r = run_task("train", spec, isolated=isolated)
        if r["status"] == "ok" and peak_gflops:
            r["utilisation"] = r["achieved_gflops"] / peak_gflops
        out[f"{preset}_{mode}"] = r
    return out


def bench_compile() -> dict[str, Any]:
    cache = CACHE / "compile-cache"
    shutil.rmtree(cache, ignore_errors=True)
    spec = {"preset": "small", "mode": "lora", "vocab_size": 1024, "cache_dir": str(cache)}
    cold = run_task("compile", spec)
    warm = run_task("compile", spec)
    out: dict[str, Any] = {"status": "ok" if cold["status"] == warm["status"] == "ok" else "failed",
                           "config": "small_lora", "cold": cold, "warm": warm}
    if out["status"] == "ok":
        out["warm_over_cold"] = warm["first_step_s"] / cold["first_step_s"]
        out["process_warm_over_cold"] = warm["process_to_first_step_s"] / cold["process_to_first_step_s"]
    return out


def bench_needle_style(train: dict[str, Any]) -> dict[str, Any]:
    r = run_task("needle_style", {"preset": "small", "vocab_size": 1024, "rows": CACTUS_ROWS, "epochs": 1})
    ours = train.get("small_lora", {})
    if r["status"] == "ok" and ours.get("status") == "ok":
        r["ours_real_tokens_per_s"] = ours["real_tokens_per_s"]
        r["speedup"] = ours["real_tokens_per_s"] / r["real_tokens_per_s"]
        r["speedup_padded"] = ours["padded_tokens_per_s"] / r["padded_tokens_per_s"]
    return r


def bench_cactus(train: dict[str, Any]) -> dict[str, Any]:
    from bench.cactus import run_cactus
    from bench.fixtures import ensure_jsonl

    cfg = model_preset("small")
    ours = train.get("small_lora", {})
    n_params = ours.get("n_params_total")
    spec = {"jsonl": str(ensure_jsonl(CACTUS_ROWS)), "vocab_size": cfg.vocab_size, "d_model": cfg.d_model,
            "n_layers": cfg.n_layers, "n_heads": cfg.n_heads, "n_kv_heads": cfg.n_kv_heads, "max_len": 256,
            "target_params": n_params or 920_000, "lora_rank": 16, "lora_alpha": 32.0, "val_split": 0.1,
            "batch_size": 16, "epochs": 1, "seed": 0}
    r = run_cactus(spec)
    r.pop("traceback", None) if r.get("ok") else None
    status = "ok" if r.pop("ok", False) else "failed"
    r = {"status": status, **r}
    if status != "ok":
        return r
    lib = run_task("library_run", {"preset": "small", "vocab_size": cfg.vocab_size, "rows": CACTUS_ROWS,
                                   "steps": r.get("steps") or 23, "eval_rows": r.get("n_val_rows")})
    r["ours"] = lib
    if lib["status"] == "ok":
        r["wall_ratio"] = r["wall_s"] / lib["wall_s"]
    if ours.get("status") == "ok" and r.get("step_s"):
        # Rows per second of training: independent of the two tokenizers' token counts.
        r["step_throughput_ratio"] = (ours["batch_size"] / ours["step_s"]) / (r["batch_size"] / r["step_s"])
        r["padded_tokens_ratio"] = ours["padded_tokens_per_s"] / r["padded_tokens_per_s"]
    return r


def bench_pipeline(train: dict[str, Any]) -> dict[str, Any]:
    step_s = train.get("small_lora", {}).get("step_s")
    out: dict[str, Any] = {"status": "ok", "flow_wall_s": None, "bare_library_wall_s": None,
                           "flow_overhead_ratio": None, "deployment_to_first_step_s": None,
                           "mlflow_logging_share": None}
    if step_s:
        m = run_task("mlflow", {"step_s": step_s, "steps": 200, "log_every": 10})
        out["mlflow"] = m
        out["mlflow_logging_share"] = m.get("share_of_step_time")
    # The flow figures come from bench/pipeline.py (embedded flow vs bare library, deployment latency).
    flow, error = run_module("bench.pipeline", "--deployment", timeout_s=3600)
    if flow is not None:
        out.update({k: flow.get(k) for k in ("flow_wall_s", "bare_library_wall_s", "flow_overhead_ratio",
                                               "deployment_to_first_step_s")})
        out["flow"] = flow
    else:
        out["status"] = "failed"
        out["error"] = error
    return out


def bench_devices() -> dict[str, Any]:
    by_count = {}
    for n in (1, 2, 4, 8):
        by_count[str(n)] = run_task("devices", {"preset": "small", "mode": "lora", "vocab_size": 1024, "steps": 9},
                                    env={"XLA_FLAGS": f"--xla_force_host_platform_device_count={n}"})
    ok = all(r["status"] == "ok" for r in by_count.values())
    return {"status": "ok" if ok else "failed", "by_count": by_count}


def bench_hf_load() -> dict[str, Any]:
    """Load time and peak RSS of a generated ~500M-parameter bf16 Hugging Face checkpoint."""
    from bench.hf_load import RESULTS

    done = subprocess.run([sys.executable, "-m", "bench.hf_load"], cwd=REPO, capture_output=True, text=True)
    if done.returncode:
        return {"status": "failed", "error": f"bench.hf_load exited {done.returncode}: {done.stderr[-800:]}"}
    return {"status": "ok", **json.loads(RESULTS.read_text())}


def bench_serve() -> dict[str, Any]:
    """bench/serve.py in its own process: the newest tuned ``small`` model (or a random one) served."""
    r, error = run_module("bench.serve", timeout_s=1800)
    return {"status": "ok", **r} if r is not None else {"status": "failed", "error": error}


def bench_memory() -> dict[str, Any]:
    """bench/memory.py in its own process (each shape and path in a child of it)."""
    r, error = run_module("bench.memory", timeout_s=4 * 3600)
    return {"status": "ok", **r} if r is not None else {"status": "failed", "error": error}


def bench_needle3_section(skip_cactus: bool) -> dict[str, Any]:
    """bench/needle3.py in its own process: cactus-needle's and needle's loop on one Needle 3 base."""
    if skip_cactus:
        return {"status": "skipped", "reason": "--skip-cactus (the comparison needs cactus-needle)"}
    r, error = run_module("bench.needle3", "--published", timeout_s=4 * 3600)
    return r if r is not None else {"status": "failed", "error": error}  # it writes its own status


def run_benchmark(quick: bool, skip_cactus: bool, sections: tuple[str, ...]) -> dict[str, Any]:
    result: dict[str, Any] = {"schema_version": SCHEMA_VERSION, "created": dt.datetime.now().isoformat(timespec="seconds"),
                              "quick": quick, "machine": machine_info()}
    result.update({s: {"status": "skipped"} for s in SECTIONS})
    result["train"] = {}
    isolated = not quick
    if "peak" in sections:
        result["peak"] = run_task("peak", {"quick": quick}, isolated=isolated)
    peak = result["peak"].get("bf16" if result["machine"]["backend"] != "cpu" else "f32", {}) or {}
    if "train" in sections:
        result["train"] = bench_train(quick, peak.get("gflops"), isolated)
    if not quick:
        if "compile" in sections:
            result["compile"] = bench_compile()
        if "needle_style" in sections:
            result["needle_style"] = bench_needle_style(result["train"])
        if "cactus" in sections and not skip_cactus:
            result["cactus"] = bench_cactus(result["train"])
        if "data_eval" in sections:
            result["data_eval"] = run_task("data_eval", {"preset": "small", "vocab_size": 1024, "eval_rows": 32})
        if "pipeline" in sections:
            result["pipeline"] = bench_pipeline(result["train"])
        if "devices" in sections:
            result["devices"] = bench_devices()
        if "hf_load" in sections:
            result["hf_load"] = bench_hf_load()
        if "serve" in sections:
            result["serve"] = bench_serve()
        if "memory" in sections:
            result["memory"] = bench_memory()
        if "needle3" in sections:
            result["needle3"] = bench_needle3_section(skip_cactus)
    if skip_cactus:
        result["cactus"] = {"status": "skipped", "reason": "--skip-cactus"}
    result["machine"]["loadavg_end"] = _load()
    result["targets"] = evaluate_targets(result)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="peak + one tiny train config, in-process (smoke test)")
    parser.add_argument("--skip-cactus", action="store_true", help="do not install or run cactus-needle")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list of {','.join(SECTIONS)}")
    parser.add_argument("--out", default="bench/results/latest.json", help="where to write the JSON")
    args = parser.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sections = tuple(s.strip() for s in args.sections.split(",") if s.strip())
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        parser.error(f"unknown sections {unknown}; choose from {list(SECTIONS)}")
    result = run_benchmark(args.quick, args.skip_cactus, sections)
    write_result(result, args.out, format_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
