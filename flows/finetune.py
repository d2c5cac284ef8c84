"""The Prefect flow `needle`: prepare → probe → (base) → fine-tune → evaluate → register.

One MLflow run per flow run (experiment `needle/<deployment>`, or `needle-local` when embedded)
holds the tags, flattened configs, step metrics, eval metrics, dataset inputs, system metrics
and artifacts; a failed run ends FAILED with the reason as a tag and registers nothing.

Embedded (in-process Prefect, SQLite MLflow under .state/):

    python -m flows.finetune [--data data/sample/new.jsonl] [--preset small] [--steps 300]

Deployed: see prefect.yaml and deployments/stack-up.sh.
"""

# No `from __future__ import annotations`: Prefect inspects the flow's parameter annotations.

import argparse
import hashlib
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any, Optional

# Training progress is logged by the `needle` logger; Prefect forwards it to the run's logs
# when this is set before Prefect configures logging (prefect.yaml sets it for worker runs).
os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "needle")

from prefect import flow, runtime  # noqa: E402
from prefect.artifacts import create_markdown_artifact  # noqa: E402

from flows import run_record as rec  # noqa: E402
from flows.params import FinetuneParams, resolve_source  # noqa: E402
from needle.config import DataConfig, ModelConfig, model_preset  # noqa: E402
from tasks.evaluate import evaluate  # noqa: E402
from tasks.prepare import TOKENIZER_SUBDIR, hash_source, prepare  # noqa: E402
from tasks.probe import probe  # noqa: E402
from tasks.register import register  # noqa: E402
from tasks.train import finetune  # noqa: E402

# Prefect attaches its handlers to extra loggers but leaves their level at WARNING (root's).
logging.getLogger("needle").setLevel(logging.INFO)

SUMMARY_KEY = "needle-run-summary"


def _digest(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _data_cfg(params: FinetuneParams, source: str, model_cfg: ModelConfig) -> DataConfig:
    return DataConfig(source=resolve_source(source), max_len=params.max_len or model_cfg.max_len, on_error=params.on_error)


def fail_fast_on_bad_rows(source: str, on_error: str) -> None:
    """Validate every row before any training, so a bad file fails in seconds with file:line."""
    from needle.data.load import validate_source
    from needle.errors import DataError

    report = validate_source(resolve_source(source))
    if report.issues and (on_error == "fail" or report.n_rows == 0):
        raise DataError(report.issues)


def ensure_base(params: FinetuneParams, state: Path, run_id: str, uri: str) -> tuple[str, dict[str, Any]]:
    """The 'auto' base: trained with mode scratch on base_data once per data, preset and config."""
    from needle.recipe import default_configs

    model_cfg = model_preset(params.preset)
    overrides = {k: v for k, v in params.train_overrides().items() if k != "steps"}
    if params.base_steps:
        overrides["steps"] = params.base_steps
    train_cfg, optim_cfg = default_configs("scratch", overrides)
    data_cfg = _data_cfg(params, params.base_data, model_cfg)
    base_dir = state / "base" / _digest(hash_source(data_cfg.source), model_cfg, train_cfg, optim_cfg, data_cfg.max_len)
    marker = base_dir / "base.json"
    if marker.exists() and Path(json.loads(marker.read_text())["model_dir"]).exists():
        cached = json.loads(marker.read_text())
        replay_base_record(cached, run_id, uri)
        return cached["model_dir"], {"cached": True, "history": cached.get("history", [])}
    prepared_dir = prepare(data_cfg, str(state / "prepared"), None, model_cfg.vocab_size)
    out = finetune(prepared_dir, model_cfg, train_cfg, optim_cfg, None, None, str(base_dir), run_id, uri, "base/")
    from mlflow.tracking import MlflowClient

    logged = MlflowClient(tracking_uri=uri).get_run(run_id).data.params
    marker.write_text(json.dumps({"model_dir": out["model_dir"], "fingerprint": out["fingerprint"],
                                  "params": {k[len("base/"):]: v for k, v in logged.items() if k.startswith("base/")},
                                  "history": out.get("history", [])}, default=str))
    return out["model_dir"], {"cached": False, **out}


def replay_base_record(cached: dict[str, Any], run_id: str, uri: str) -> None:
    """Log a cached base's params and training curve again, so every run has the same keys."""
    from tasks.train import make_tracker

    tracker = make_tracker(run_id, uri, "base/")  # the prefix the base's own training logged under
    tracker.log_params(cached.get("params", {}))
    for record in cached.get("history", []):
        tracker.log_metrics({k: float(v) for k, v in record.items() if isinstance(v, (int, float))}, step=int(record["step"]))
    tracker.finish()


def run_pipeline(params: FinetuneParams, state: Path, run_id: str, uri: str, client: Any) -> dict[str, Any]:
    """The stages, in order; raises on the first failure (the caller records it)."""
    from needle.recipe import default_configs, resolve_model

    tracker = rec_tracker(run_id, uri)
    tracker.log_params({"flow.data": params.data, "flow.base_model": params.base_model, "flow.mode": params.mode,
                        "flow.preset": params.preset, **{f"eval.{k}": v for k, v in params.eval.model_dump().items()}})
    fail_fast_on_bad_rows(params.data, params.on_error)
    auto = params.base_model == "auto"
    if auto:  # prepare the base data first: the fine-tune data needs the base's tokenizer
        fail_fast_on_bad_rows(params.base_data, params.on_error)
        hw = probe()
        base_dir, base_info = ensure_base(params, state, run_id, uri)
    else:
        base_dir = resolve_source(params.base_model)
    model_cfg, _ = resolve_model(params.mode, params.preset, base_dir)
    data_cfg = _data_cfg(params, params.data, model_cfg)
    prepared_dir = prepare(data_cfg, str(state / "prepared"), base_dir, model_cfg.vocab_size)
    if not auto:
        hw, base_info = probe(), {"cached": None}
    fingerprint = rec.log_dataset(run_id, prepared_dir, data_cfg.source, client)
    tracker.log_params({f"data.{k}": v for k, v in data_cfg.model_dump(mode="json").items()})
    tracker.set_tags({"backend": hw["backend"], "device_kind": hw["device_kind"], "device_count": hw["device_count"],
                      "jax_version": hw["jax_version"], "data_fingerprint": fingerprint, "base_model_dir": base_dir,
                      "base_cached": base_info.get("cached")})

    train_cfg, optim_cfg = default_configs(params.mode, params.train_overrides(), params.optim_overrides())
    key = _digest(fingerprint, model_cfg, train_cfg, optim_cfg, params.lora, base_dir)
    run_dir = state / "runs" / str(runtime.flow_run.id or "local")
    tuned = finetune(prepared_dir, model_cfg, train_cfg, optim_cfg, params.lora, base_dir,
                     str(run_dir / f"{params.mode}-{key}"), run_id, uri)
    tracker.log_metrics({k: tuned[k] for k in ("train_loss", "val_loss", "wall_s", "tokens_per_s")
                         if isinstance(tuned.get(k), (int, float))}, step=tuned["final_step"])

    report = evaluate(base_dir, tuned["model_dir"], prepared_dir, params.eval, str(run_dir / "eval"))
    metrics = rec.eval_metrics(report["comparison"])
    tracker.log_metrics(metrics, step=tuned["final_step"])

    histories = {"tuned": tuned["history"]}
    if base_info.get("history"):
        histories["base"] = base_info["history"]
    plot = rec.plot_losses(histories, run_dir / "plots" / "loss.png")
    tracker.log_artifact(tuned["model_dir"], "model")
    tracker.log_artifact(Path(prepared_dir) / TOKENIZER_SUBDIR, "tokenizer")
    tracker.log_artifact(report["report_dir"], "eval")
    tracker.log_artifact(plot, "plots")
    rec.log_example_table(client, run_id, Path(report["report_dir"]) / "tuned" / "examples.jsonl", "eval/tuned_examples_table.json")
    tracker.finish()
    version = register(run_id, uri, report["tuned"]) if params.register_model else None
    return {"hw": hw, "metrics": {"train_loss": tuned["train_loss"], "val_loss": tuned["val_loss"], **metrics},
            "model_version": version, "model_dir": tuned["model_dir"]}


def rec_tracker(run_id: str, uri: str) -> Any:
    """The flow's own tracker on the run (metrics flushed at once: the flow logs few)."""
    from needle.tracking import MlflowTracker

    return MlflowTracker(run_id, uri, flush_every=1, terminate_on_finish=False)


def _start_mlflow_run(uri: str) -> tuple[Any, str, str, str]:
    """Start (or, for a restarted flow run, resume) the flow run's MLflow run in this thread."""
    import mlflow
    from mlflow.tracking import MlflowClient

    mlflow.set_tracking_uri(uri)
    client = MlflowClient(tracking_uri=uri)
    deployment = runtime.deployment.name
    exp_name = rec.experiment_name(deployment)
    exp_id = rec.ensure_experiment(client, exp_name, uri)
    flow_run_id = str(runtime.flow_run.id)
    earlier = client.search_runs([exp_id], f"tags.`prefect.flow_run_id` = '{flow_run_id}'", max_results=1)
    run = mlflow.start_run(
        run_id=earlier[0].info.run_id if earlier else None,
        experiment_id=None if earlier else exp_id,
        run_name=None if earlier else runtime.flow_run.name,
        log_system_metrics=True,
        tags={"prefect.flow_run_id": flow_run_id, "prefect.flow_run_name": str(runtime.flow_run.name),
              "prefect.deployment": str(deployment), "git_commit": rec.git_commit()},
    )
    return client, exp_id, exp_name, run.info.run_id


@flow(name="needle", log_prints=True)
def needle(params: FinetuneParams = FinetuneParams()) -> dict[str, Any]:
    """Fine-tune a tool-calling model and record everything in MLflow."""
    import mlflow

    state = rec.state_dir()
    uri = rec.tracking_uri(state)
    client, exp_id, exp_name, run_id = _start_mlflow_run(uri)
    info: dict[str, Any] = {"run_id": run_id, "experiment": exp_name, "ui_link": rec.ui_link(uri, exp_id, run_id),
                            "ui_hint": None if uri.startswith("http") else f"mlflow ui --backend-store-uri {uri}"}
    try:
        out = run_pipeline(params, state, run_id, uri, client)
    except BaseException as exc:
        reason = f"{type(exc).__name__}: {exc}"
        client.set_tag(run_id, "failure_reason", reason[:7900])
        # A cancelled or interrupted run is KILLED; anything that went wrong is FAILED.
        mlflow.end_run("FAILED" if isinstance(exc, Exception) else "KILLED")
        create_markdown_artifact(key=SUMMARY_KEY, markdown=rec.summary_markdown({**info, "status": "FAILED", "error": reason}),
                                 description="needle run failed")
        raise
    mlflow.end_run("FINISHED")
    hw = out.pop("hw")
    info.update(status="FINISHED", backend=hw["backend"], device_count=hw["device_count"],
                device_kind=hw["device_kind"], metrics=out["metrics"], model_version=out["model_version"])
    create_markdown_artifact(key=SUMMARY_KEY, markdown=rec.summary_markdown(info), description="needle run summary")
    print(f"MLflow run {run_id} in experiment {exp_name}: {info['ui_link']}")
    return {**out, "run_id": run_id, "experiment_id": exp_id, "tracking_uri": uri}


def run_embedded(**params: Any) -> dict[str, Any]:
    """Run the flow in-process with Prefect and MLflow state under .state/ in the checkout."""
    state = rec.state_dir()
    defaults = {
        "PREFECT_HOME": str(state / "prefect"),
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "90",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DO_NOT_TRACK": "1",
        "MLFLOW_TRACKING_URI": rec.tracking_uri(state),
    }
    for key, value in defaults.items():
        os.environ.setdefault(key, value)
    p = FinetuneParams(**{k: v for k, v in params.items() if v is not None})
    Path(os.environ["PREFECT_HOME"]).mkdir(parents=True, exist_ok=True)
    from prefect.context import SettingsContext
    from prefect.settings import Settings

    # Prefect read its settings when it was imported; settings derived from PREFECT_HOME (the
    # database, result storage) must be rebuilt from the environment set above.
    with SettingsContext(profile=SettingsContext.get().profile, settings=Settings()):
        result = needle(p)
    uri = result["tracking_uri"]
    print(f"\nMLflow run {result['run_id']} (tracking URI {uri})")
    version = (result.get("model_version") or {}).get("version")
    print(f"Tuned model: {result['model_dir']}" + (f"  (registered: models:/needle/{version})" if version else ""))
    if not uri.startswith("http"):
        print(f"Browse it: mlflow ui --backend-store-uri {uri}  then open "
              f"{rec.ui_link(uri, result['experiment_id'], result['run_id'])}")
    return result


def main(argv: Optional[list[str]] = None) -> int:
    """`python -m flows.finetune`: the embedded flow with a few common overrides."""
    parser = argparse.ArgumentParser(description="run the needle flow in-process")
    parser.add_argument("--data", default=None, help="JSONL path, glob or hub id (default: bundled sample)")
    parser.add_argument("--preset", default=None)
    parser.add_argument("--base", dest="base_model", default=None, help="base model dir or 'auto'")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--params", default=None, help="further FinetuneParams as a JSON object")
    args = parser.parse_args(argv)
    extra = json.loads(args.params) if args.params else {}
    run_embedded(data=args.data, preset=args.preset, base_model=args.base_model, steps=args.steps, **extra)
    return 0


if __name__ == "__main__":
    sys.exit(main())
