"""Pipeline overhead: what Prefect and MLflow add on top of the bare library.

Measures, on the same base model, data and config (LoRA on ``data/sample/new.jsonl``):

- ``bare_library_wall_s``: a fresh process that runs the same stages as the flow
  (``needle.pipeline``: validate, base, prepare, train, evaluate base and tuned on the test split)
  as plain calls: no Prefect, no tracking, no registration;
- ``flow_wall_s``: a fresh process running the embedded flow (``needle finetune``: ephemeral
  Prefect API, MLflow on SQLite, same stages plus tracking, artifacts and registration), with
  new Prefect and MLflow state (``flow_cold_*``) and again with that state kept (``flow_*``);
- with ``--deployment``: a local stack (deployments/stack-up.sh on free ports) with a warm server
  and worker; the time from ``prefect deployment run`` to the flow run Running, to the
  fine-tune task starting, and to the first training step's loss in MLflow.

    python -m bench.pipeline [--steps 120] [--base-steps 300] [--deployment] [--out FILE]

The base is trained once (cached under .cache/bench/pipeline) and passed to both paths, so
neither pays for it. Prints a table and writes JSON (keys in docs/benchmark.md).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from needle.config import DataConfig, EvalConfig, LoraConfig, training_configs

REPO = Path(__file__).resolve().parent.parent
CACHE = REPO / ".cache" / "bench" / "pipeline"
DATA = REPO / "data" / "sample" / "new.jsonl"
BASE_DATA = REPO / "data" / "sample" / "base.jsonl"
PRESET = "small"


def ensure_base(base_steps: int) -> Path:
    """A scratch base on the base tools (library path), built once per step count."""
    out = CACHE / f"base-{PRESET}-{base_steps}"
    model = out / "model"
    if not (model / "config.json").exists():
        cmd = [sys.executable, "-m", "needle.cli", "train", str(BASE_DATA), "--mode", "scratch",
               "--preset", PRESET, "--steps", str(base_steps), "--out", str(out)]
        subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    return model


def bare_main(base_dir: str, steps: int, out: str) -> None:
    """The library-only run (in its own process): the flow's stages with its defaults."""
    # lazy: only this child runs the library; the parent that times it holds no jax
    from needle import pipeline

    source = pipeline.load_data(str(DATA))
    base = pipeline.obtain_base(base_dir)
    data_cfg = DataConfig(source=str(DATA), max_len=base.model_cfg.max_len)
    prepared = pipeline.prepare_data(data_cfg, source, tokenizer=base.tokenizer, cache_dir=Path(out) / "prepared")
    train_cfg, optim_cfg = training_configs("lora", steps=steps)
    tuned = pipeline.train(prepared, base.model_cfg, train_cfg, optim_cfg, LoraConfig(), base=base, out_dir=out)
    pipeline.evaluate(base, tuned.model_dir, prepared, EvalConfig(), Path(out) / "eval")


def _timed(cmd: list[str], env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd[:4])} exited {done.returncode}: {done.stderr[-2000:]}")
    return wall


def measure_local(base: Path, steps: int) -> dict[str, Any]:
    """Bare library vs embedded flow, each in a fresh process."""
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    with tempfile.TemporaryDirectory(prefix="bench-pipeline-") as tmp:
        bare = _timed([sys.executable, "-m", "bench.pipeline", "_bare", str(base), str(steps), f"{tmp}/bare"], env)
        flow_env = {**env, "NEEDLE_STATE_DIR": f"{tmp}/state", "PREFECT_HOME": f"{tmp}/state/prefect",
                    "MLFLOW_TRACKING_URI": f"sqlite:///{tmp}/state/mlflow.db"}
        cmd = [sys.executable, "-m", "needle_flows.cli", "finetune", str(DATA), "--preset", PRESET,
               "--base", str(base), "--steps", str(steps)]
        cold = _timed(cmd, flow_env)
        # Same state: Prefect's DB exists, prepared data is cached. Forced, because the same
        # inputs would otherwise end as "skipped: data unchanged" (flows/finetune.py) untrained.
        warm = _timed([*cmd, "--params", json.dumps({"force": True})], flow_env)
    return {"steps": steps, "bare_library_wall_s": bare, "flow_cold_wall_s": cold, "flow_wall_s": warm,
            "flow_overhead_s": warm - bare, "flow_overhead_ratio": (warm - bare) / warm,
            "flow_cold_overhead_ratio": (cold - bare) / cold}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _first_step_time(uri: str, after_ms: int, timeout_s: float) -> tuple[str, float]:
    """(run id, epoch seconds of its step-1 loss) for the first MLflow run started after ``after_ms``."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        exp = client.get_experiment_by_name("needle/finetune")
        runs = client.search_runs([exp.experiment_id], f"attributes.start_time > {after_ms}") if exp else []
        for run in runs:
            first = [m for m in client.get_metric_history(run.info.run_id, "loss") if m.step == 1]
            if first:
                return run.info.run_id, first[0].timestamp / 1000
        time.sleep(0.2)
    raise TimeoutError(f"no step-1 loss in MLflow within {timeout_s:.0f} s")


def _prefect_times(env: dict[str, str], flow_run_id: str) -> dict[str, float]:
    """Epoch seconds when the flow run started and when its train task run started."""
    script = f"""
import asyncio, json
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
async def main():
    async with get_client() as c:
        fr = await c.read_flow_run("{flow_run_id}")
        trs = await c.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[fr.id])))
        ft = [t.start_time.timestamp() for t in trs if t.name.startswith("train") and t.start_time]
        print(json.dumps({{"flow_start": fr.start_time.timestamp(), "train_start": min(ft) if ft else None}}))
asyncio.run(main())
"""
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure_deployment(base: Path, steps: int) -> dict[str, Any]:
    """Time from `prefect deployment run` to the first step, with a warm server and worker."""
    bin_dir = Path(sys.executable).parent
    with tempfile.TemporaryDirectory(prefix="bench-stack-") as tmp:
        pp, mp = _free_port(), _free_port()
        env = {**os.environ, "NEEDLE_STACK_DIR": f"{tmp}/stack", "NEEDLE_STATE_DIR": f"{tmp}/state",
               "NEEDLE_BIN": str(bin_dir), "PREFECT_PORT": str(pp), "MLFLOW_PORT": str(mp),
               "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu"), "PREFECT_WORKER_QUERY_SECONDS": "2",
               "PREFECT_HOME": f"{tmp}/stack/prefect", "PREFECT_API_URL": f"http://127.0.0.1:{pp}/api",
               "MLFLOW_TRACKING_URI": f"http://127.0.0.1:{mp}", "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
        try:
            subprocess.run([str(REPO / "deployments" / "stack-up.sh")], env=env, check=True, capture_output=True)
            params = {"data": str(DATA), "base_model": str(base), "preset": PRESET, "steps": steps,
                      "train": {"log_every": 1}}
            run = ["prefect", "deployment", "run", "needle/finetune", "--param", f"params={json.dumps(params)}"]
            # Warm-up run: the worker, server and the prepared-data cache are now warm.
            subprocess.run([*run, "--watch"], env=env, check=True, capture_output=True, cwd=REPO)
            # The measured run has the same inputs, so it must be forced: unforced, it would end
            # as "skipped: data unchanged" without a training step (flows/finetune.py).
            forced = ["prefect", "deployment", "run", "needle/finetune", "--param",
                      f"params={json.dumps({**params, 'force': True})}"]  # fmt: skip
            t0 = time.time()
            out = subprocess.run(forced, env=env, check=True, capture_output=True, text=True, cwd=REPO).stdout
            flow_run_id = next(w for line in out.splitlines() if "UUID" in line for w in line.split()
                               if len(w) == 36 and w.count("-") == 4)
            _, first_step = _first_step_time(env["MLFLOW_TRACKING_URI"], int(t0 * 1000) - 1000, 900)
            times = _prefect_times(env, flow_run_id)
            # Only the latency was wanted: stop the run (stack-down also stops leftover flow runs).
            subprocess.run(["prefect", "flow-run", "cancel", flow_run_id], env=env, capture_output=True, cwd=REPO)
        finally:
            subprocess.run([str(REPO / "deployments" / "stack-down.sh")], env=env, capture_output=True)
    return {"deployment_to_running_s": times["flow_start"] - t0,
            "deployment_to_train_task_s": (times["train_start"] - t0) if times["train_start"] else None,
            "deployment_to_first_step_s": first_step - t0}


def format_rows(result: dict[str, Any]) -> str:
    """The printed table."""
    rows = [(k, f"{v:.2f}" if isinstance(v, float) else str(v)) for k, v in result.items()]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "_bare":
        bare_main(*argv[1:2], int(argv[2]), argv[3])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=120, help="LoRA steps of the measured run")
    parser.add_argument("--base-steps", type=int, default=300, help="steps of the cached scratch base")
    parser.add_argument("--deployment", action="store_true", help="also time a deployment run on a local stack")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "pipeline.json"))
    args = parser.parse_args(argv)
    base = ensure_base(args.base_steps)
    result: dict[str, Any] = {"preset": PRESET, **measure_local(base, args.steps)}
    if args.deployment:
        result.update(measure_deployment(base, args.steps))
    print(format_rows(result))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
