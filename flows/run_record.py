"""What the `needle` flow records in MLflow and Prefect: the run's life, tags, inputs, plots, summary.

Kept apart from the flow so the flow reads as the pipeline it runs. Everything here talks to
MLflow through ``MlflowClient`` with an explicit run id (thread-safe; see needle.tracking.tracker),
except ``start_run``/``end_*``, which own the flow thread's active run.

    run = start_run(tracking_uri(state_dir()))       # (needle_flows.paths)
    record_inputs(run, tracker, ...); record_results(run, tracker, ...); end_finished(run, tracker, out)
"""

import json
import os
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import mlflow
from mlflow.tracking import MlflowClient
from prefect import runtime
from prefect.artifacts import create_markdown_artifact

from needle import pipeline
from needle.data.prepare import TOKENIZER_SUBDIR
from needle.serve.pyfunc import log_pyfunc_to_run
from needle.tracking.mlflow_tracker import (
    HEARTBEAT_TAG, MlflowTracker, check_tracking, tracking_reachable, upload_pending_metrics,
)  # fmt: skip
from needle.tracking.redaction import redact_uri
from needle.tracking.tracker import Tracker
from needle.train.loop import TrainResult
from needle_flows.params import FinetuneParams
from needle_flows.paths import CHECKOUT, state_dir
from needle_flows.reaper import watch_ephemeral_server

LOCAL_EXPERIMENT = "needle-local"
DEFAULT_UI = "http://127.0.0.1:5000"
SUMMARY_KEY = "needle-run-summary"
HOST_TAG, PID_TAG, PID_STARTED_TAG = "needle.host", "needle.pid", "needle.pid_started"
STALE_AFTER_S = 15 * 60  # a run elsewhere with no heartbeat for this long is dead (the beat is every minute)


@dataclass(frozen=True)
class MlflowRun:
    """The flow run's MLflow run: where it is tracked and how to reach it."""

    client: Any
    uri: str
    experiment_id: str
    experiment: str
    run_id: str

    @property
    def info(self) -> dict[str, Any]:
        """The summary fields every outcome shares (the URI's credentials redacted: it is stored)."""
        uri = redact_uri(self.uri)
        hint = None if uri.startswith("http") else f"mlflow ui --backend-store-uri {uri}"
        return {"run_id": self.run_id, "experiment": self.experiment,
                "ui_link": ui_link(uri, self.experiment_id, self.run_id), "ui_hint": hint}


def artifact_location(uri: str) -> Optional[str]:
    """For a SQLite store, artifacts beside the database; a tracking server decides itself."""
    if not uri.startswith("sqlite:"):
        return None
    db = Path(uri[len("sqlite:///"):])  # sqlite:////abs/db -> /abs/db; sqlite:///rel/db -> rel/db
    return (db.parent / "mlartifacts").resolve().as_uri()


def experiment_name(deployment: Optional[str]) -> str:
    """`needle/<deployment>` for deployment runs, `needle-local` for embedded ones."""
    return f"needle/{deployment}" if deployment else LOCAL_EXPERIMENT


def ensure_experiment(client: Any, name: str, uri: str) -> str:
    """The id of the named experiment, created (with our artifact location) if missing."""
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    return client.create_experiment(name, artifact_location=artifact_location(uri))


def git_commit() -> str:
    """The checkout's HEAD commit, or 'unknown' outside a git checkout."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=CHECKOUT, capture_output=True, text=True, timeout=10, check=True
        )
        return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def ui_link(uri: str, experiment_id: str, run_id: str) -> str:
    """A browser link to the run (for a SQLite store: where `mlflow ui` serves it by default);
    credentials in the URI are redacted."""
    base = redact_uri(uri).rstrip("/") if uri.startswith("http") else DEFAULT_UI
    return f"{base}/#/experiments/{experiment_id}/runs/{run_id}"


def start_run(uri: str) -> MlflowRun:
    """Start (or, for a restarted flow run, resume) the flow run's MLflow run in this thread.

    First it checks that the store answers (seconds, not MLflow's minutes of retries), uploads
    metrics an earlier run could not deliver, and marks runs whose process died KILLED.
    """
    check_tracking(uri)
    watch_ephemeral_server()  # embedded: a kill -9 of this process must not leave Prefect's server up
    mlflow.set_tracking_uri(uri)
    client = MlflowClient(tracking_uri=uri)
    upload_pending_metrics(client, pending_metrics_dir())
    deployment = runtime.deployment.name
    exp_name = experiment_name(deployment)
    exp_id = ensure_experiment(client, exp_name, uri)
    flow_run_id = str(runtime.flow_run.id)
    mark_stale_runs(client, exp_id, flow_run_id)
    earlier = client.search_runs([exp_id], f"tags.`prefect.flow_run_id` = '{flow_run_id}'", max_results=1)
    run = mlflow.start_run(
        run_id=earlier[0].info.run_id if earlier else None,
        experiment_id=None if earlier else exp_id,
        run_name=None if earlier else runtime.flow_run.name,
        log_system_metrics=True,
        tags={"prefect.flow_run_id": flow_run_id, "prefect.flow_run_name": str(runtime.flow_run.name),
              "prefect.deployment": str(deployment), "git_commit": git_commit(), **process_tags()},
    )
    return MlflowRun(client, uri, exp_id, exp_name, run.info.run_id)


def pending_metrics_dir() -> Path:
    """Where a tracker spills metrics MLflow did not take; the next run uploads them."""
    return state_dir() / "pending-metrics"


def process_tags() -> dict[str, str]:
    """Which process owns the run (host, pid, its start time): how a later run tells it died."""
    import psutil

    return {HOST_TAG: socket.gethostname(), PID_TAG: str(os.getpid()),
            PID_STARTED_TAG: f"{psutil.Process().create_time():.2f}"}


def run_is_stale(tags: dict[str, str], now: float, stale_after_s: float = STALE_AFTER_S) -> Optional[str]:
    """Why a RUNNING run is dead, or None if it may be alive: its process on this host is gone,
    or (elsewhere) its heartbeat stopped ``stale_after_s`` ago. Runs without needle's tags are
    left alone."""
    import psutil

    if tags.get(HOST_TAG) == socket.gethostname() and tags.get(PID_TAG, "").isdigit():
        try:
            started = psutil.Process(int(tags[PID_TAG])).create_time()
        except psutil.Error:
            return f"its process {tags[PID_TAG]} on this host is gone"
        if abs(started - float(tags.get(PID_STARTED_TAG, started))) > 1.0:
            return f"its process {tags[PID_TAG]} on this host is gone (the pid was reused)"
        return None
    beat = tags.get(HEARTBEAT_TAG, "")
    if beat.isdigit() and now - int(beat) > stale_after_s:
        return f"no heartbeat for {(now - int(beat)) / 60:.0f} min"
    return None


def mark_stale_runs(client: Any, experiment_id: str, own_flow_run_id: str) -> list[str]:
    """End RUNNING runs of the experiment whose process died (kill -9, a lost machine) as
    KILLED, with the reason as tag ``failure_reason``; returns their ids."""
    import time

    ended = []
    for r in client.search_runs([experiment_id], "attributes.status = 'RUNNING'", max_results=200):
        tags = dict(r.data.tags)
        if tags.get("prefect.flow_run_id") == own_flow_run_id:
            continue  # our own run, resumed by a retry of this flow run
        why = run_is_stale(tags, time.time())
        if why is None:
            continue
        client.set_tag(r.info.run_id, "failure_reason", f"marked KILLED by a later run: {why}")
        client.set_terminated(r.info.run_id, status="KILLED")
        print(f"MLflow run {r.info.run_id} was left RUNNING but {why}: marked KILLED")
        ended.append(r.info.run_id)
    return ended


def end_failed(run: MlflowRun, tracker: Tracker, exc: BaseException) -> None:
    """Mark the run FAILED (KILLED when cancelled or interrupted) with the reason as a tag."""
    reason = redact_uri(f"{type(exc).__name__}: {exc}")  # an MLflow error quotes the URI
    if tracking_reachable(run.uri):
        tracker.finish()  # what was logged before the failure still lands (or is spilled)
        run.client.set_tag(run.run_id, "failure_reason", reason[:7900])
        mlflow.end_run("FAILED" if isinstance(exc, Exception) else "KILLED")
    else:
        # The failure may be the outage itself: one line, not a second traceback; the next run
        # finds this run stale and marks it KILLED.
        print(f"MLflow at {redact_uri(run.uri)} is unreachable: run {run.run_id} stays RUNNING until the next "
              "run marks it")
        if isinstance(tracker, MlflowTracker):
            tracker.finish_timeout = 0  # spill the metrics now for the next run
        tracker.finish()
    create_markdown_artifact(key=SUMMARY_KEY, markdown=summary_markdown({**run.info, "status": "FAILED", "error": reason}),
                             description="needle run failed")


def end_finished(run: MlflowRun, tracker: Tracker, out: dict[str, Any]) -> dict[str, Any]:
    """Mark the run FINISHED, publish the Prefect summary; return the flow's result."""
    tracker.finish()
    mlflow.end_run("FINISHED")
    hw = out.pop("hw")
    info = {**run.info, "status": "FINISHED", "backend": hw["backend"], "device_count": hw["device_count"],
            "device_kind": hw["device_kind"], "metrics": out["metrics"], "model_version": out["model_version"]}
    create_markdown_artifact(key=SUMMARY_KEY, markdown=summary_markdown(info), description="needle run summary")
    print(f"MLflow run {run.run_id} in experiment {run.experiment}: {info['ui_link']}")
    # The flow's result is stored by Prefect: the tracking URI goes in without its credentials.
    return {**out, "run_id": run.run_id, "experiment_id": run.experiment_id, "tracking_uri": redact_uri(run.uri)}


def record_inputs(run: MlflowRun, tracker: Tracker, p: FinetuneParams, data_cfg: Any, base: pipeline.Base,
                  prepared: pipeline.PreparedSet, hw: dict[str, Any]) -> None:
    """The run's flow params, dataset inputs, data config and tags (backend, data, base)."""
    tracker.log_params({"flow.data": p.data, "flow.base_model": p.base_model, "flow.mode": p.mode,
                        "flow.preset": p.preset or base.model_cfg.preset,
                        **{f"eval.{k}": v for k, v in p.eval.model_dump().items()}})
    log_dataset(run.run_id, prepared.data, data_cfg.source, run.client)
    tracker.log_params({f"data.{k}": v for k, v in data_cfg.model_dump(mode="json").items()})
    tracker.log_params({f"base_model.{k}": v for k, v in base.describe().items()})
    tracker.set_tags({"backend": hw["backend"], "device_kind": hw["device_kind"], "device_count": hw["device_count"],
                      "jax_version": hw["jax_version"], "data_fingerprint": prepared.fingerprint,
                      "base_model_dir": base.model_dir, "base_cached": base.cached})


def record_results(run: MlflowRun, tracker: Tracker, base: pipeline.Base, prepared: pipeline.PreparedSet,
                   tuned: TrainResult, report: pipeline.Evaluation, run_dir: Path,
                   exports: dict[str, Path]) -> dict[str, float]:
    """Final losses, eval metrics, artifacts, the loss plot and the example table; the eval metrics."""
    tracker.log_metrics({k: getattr(tuned, k) for k in ("train_loss", "val_loss", "wall_s", "tokens_per_s")
                         if isinstance(getattr(tuned, k), (int, float))}, step=tuned.final_step)
    metrics = eval_metrics(report.comparison)
    tracker.log_metrics(metrics, step=tuned.final_step)
    histories = {"tuned": tuned.history}
    if base.record and base.record.get("history"):
        histories["base"] = base.record["history"]
    log_pyfunc_to_run(run.client, run.run_id, tuned.model_dir)  # "model": an MLflow pyfunc that is a needle dir too
    for fmt, path in exports.items():
        tracker.log_artifact(path, f"export/{fmt}")  # export/hf (transformers), export/peft (adapter)
    tracker.log_artifact(Path(prepared.directory) / TOKENIZER_SUBDIR, "tokenizer")
    tracker.log_artifact(report.report_dir, "eval")
    tracker.log_artifact(plot_losses(histories, run_dir / "plots" / "loss.png"), "plots")
    log_example_table(run.client, run.run_id, report.report_dir / "tuned" / "examples.jsonl",
                      "eval/tuned_examples_table.json")
    return metrics


def log_dataset(run_id: str, prepared: Any, source: str, client: Any) -> str:
    """Log the splits as MLflow dataset inputs, with the data fingerprint as the digest."""
    import mlflow.data
    from mlflow.entities import DatasetInput, InputTag

    for split in ("train", "val", "test"):
        # The token-id list columns defeat MLflow's schema inference; the text columns describe it.
        table = prepared.splits[split].select_columns(["query", "tools", "answers", "length", "source"])
        ds = mlflow.data.from_huggingface(table, name=f"{Path(source).stem}-{split}", digest=prepared.fingerprint[:20])
        ds.schema = dataset_schema(table.features)  # declared, not inferred: no integer-column hint per split
        tags = [InputTag("mlflow.data.context", split), InputTag("fingerprint", prepared.fingerprint),
                InputTag("source", source)]
        client.log_inputs(run_id, [DatasetInput(ds._to_mlflow_entity(), tags=tags)])
    return prepared.fingerprint


def dataset_schema(features: Any) -> Any:
    """The MLflow schema of a Hugging Face table's scalar columns, from its declared features.

    MLflow infers a dataset's schema from its rows and then warns about every integer column (it
    could not hold a missing value); the prepared splits declare their types, and ``length`` is
    never missing, so the schema is read from the features instead.
    """
    from mlflow.types.schema import ColSpec, Schema

    types = {"string": "string", "large_string": "string", "bool": "boolean", "int8": "integer",
             "int16": "integer", "int32": "integer", "int64": "long", "float32": "float", "float64": "double"}
    return Schema([ColSpec(types[f.dtype], name) for name, f in features.items()])


def new_plot() -> tuple[Any, Any]:
    """A figure and its axes for a run's PNG plots, drawn off screen (matplotlib's Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=(7, 4))


def save_plot(fig: Any, ax: Any, xlabel: str, ylabel: str, path: Path) -> Path:
    """Label, legend and grid the axes, write the figure to ``path`` as PNG and close it."""
    import matplotlib.pyplot as plt

    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend()
    ax.grid(alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path


def plot_losses(histories: dict[str, list[dict[str, Any]]], path: Path) -> Path:
    """A loss-curve PNG: train (and validation) loss against step for each training stage."""
    fig, ax = new_plot()
    for label, history in histories.items():
        steps = [r["step"] for r in history if "loss" in r]
        ax.plot(steps, [r["loss"] for r in history if "loss" in r], label=f"{label} train")
        val = [(r["step"], r["val_loss"]) for r in history if r.get("val_loss") is not None]
        if val:
            ax.plot(*zip(*val), "o--", label=f"{label} val")
    return save_plot(fig, ax, "step", "loss", path)


def log_example_table(client: Any, run_id: str, examples_jsonl: Path, artifact_file: str) -> None:
    """Per-example evaluation rows as an MLflow table (nested values as JSON text)."""
    import pandas as pd

    rows = [json.loads(line) for line in examples_jsonl.read_text(encoding="utf-8").splitlines() if line]
    flat = [{k: v if isinstance(v, (str, int, float, bool)) or v is None else json.dumps(v) for k, v in r.items()}
            for r in rows]
    client.log_table(run_id, pd.DataFrame(flat), artifact_file)


def eval_metrics(comparison: dict[str, dict[str, Any]]) -> dict[str, float]:
    """`base_<m>`, `tuned_<m>`, `delta_<m>` for each numeric metric of the comparison."""
    out: dict[str, float] = {}
    for metric, row in comparison.items():
        for side in ("base", "tuned", "delta"):
            if isinstance(row.get(side), (int, float)):
                out[f"{side}_{metric}"] = float(row[side])
    return out


def summary_markdown(info: dict[str, Any]) -> str:
    """The Prefect artifact that summarises one run: devices, key metrics, where the run lives
    (any URI's credentials redacted)."""
    lines = [
        f"# needle run: {info['status']}",
        "",
        f"- backend: **{info.get('backend', '?')}**, devices: {info.get('device_count', '?')} x "
        f"{info.get('device_kind', '?')}",
        f"- MLflow run: `{info['run_id']}` in experiment `{info['experiment']}`",
        f"- MLflow UI: {info['ui_link']}",
    ]
    if info.get("ui_hint"):
        lines.append(f"- start the UI with: `{info['ui_hint']}`")
    if info.get("error"):
        lines += ["", "## Failure", "", "```", str(info["error"])[:4000], "```"]
    if info.get("metrics"):
        lines += ["", "| metric | value |", "|---|---|"]
        lines += [f"| {k} | {v:.4f} |" if isinstance(v, float) else f"| {k} | {v} |" for k, v in info["metrics"].items()]
    if info.get("model_version"):
        lines.append(f"\nRegistered `{info['model_version']['name']}` version {info['model_version']['version']}"
                     f"{' (champion)' if info['model_version']['champion'] else ''}.")
    return redact_uri("\n".join(lines) + "\n")  # an artifact is stored: no URI credentials
