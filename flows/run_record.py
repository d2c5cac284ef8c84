"""What the `needle` flow records in MLflow and Prefect: locations, tags, inputs, plots, summary.

Kept apart from the flow so the flow reads as the pipeline it runs. Everything here talks to
MLflow through ``MlflowClient`` with an explicit run id (thread-safe; see needle.tracking).

    uri = tracking_uri(state_dir())          # MLFLOW_TRACKING_URI, or SQLite under .state/
"""

import json
import os
import subprocess
from pathlib import Path
from typing import Any, Optional

from flows.params import CHECKOUT

LOCAL_EXPERIMENT = "needle-local"
DEFAULT_UI = "http://127.0.0.1:5000"


def state_dir() -> Path:
    """Where runs, caches and the default MLflow store live: $NEEDLE_STATE_DIR or .state/."""
    return Path(os.environ.get("NEEDLE_STATE_DIR") or CHECKOUT / ".state").resolve()


def tracking_uri(state: Path) -> str:
    """MLFLOW_TRACKING_URI if set, else an absolute SQLite store in the state dir (never cwd)."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{state / 'mlflow.db'}"


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
    """A browser link to the run (for a SQLite store: where `mlflow ui` serves it by default)."""
    base = uri.rstrip("/") if uri.startswith("http") else DEFAULT_UI
    return f"{base}/#/experiments/{experiment_id}/runs/{run_id}"


def log_dataset(run_id: str, prepared_dir: str, source: str, client: Any) -> str:
    """Log the training split as an MLflow dataset input, with its fingerprint as the digest."""
    import mlflow.data
    from mlflow.entities import DatasetInput, InputTag

    from needle.data.prepare import PreparedData

    prepared = PreparedData.load(prepared_dir)
    for split in ("train", "val", "test"):
        # The token-id list columns defeat MLflow's schema inference; the text columns describe it.
        table = prepared.splits[split].select_columns(["query", "tools", "answers", "length", "source"])
        ds = mlflow.data.from_huggingface(table, name=f"{Path(source).stem}-{split}", digest=prepared.fingerprint[:20])
        tags = [InputTag("mlflow.data.context", split), InputTag("fingerprint", prepared.fingerprint),
                InputTag("source", source)]
        client.log_inputs(run_id, [DatasetInput(ds._to_mlflow_entity(), tags=tags)])
    return prepared.fingerprint


def plot_losses(histories: dict[str, list[dict[str, Any]]], path: Path) -> Path:
    """A loss-curve PNG: train (and validation) loss against step for each training stage."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, history in histories.items():
        steps = [r["step"] for r in history if "loss" in r]
        ax.plot(steps, [r["loss"] for r in history if "loss" in r], label=f"{label} train")
        val = [(r["step"], r["val_loss"]) for r in history if r.get("val_loss") is not None]
        if val:
            ax.plot(*zip(*val), "o--", label=f"{label} val")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend()
    ax.grid(alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path


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
    """The Prefect artifact that summarises one run: devices, key metrics, where the run lives."""
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
    return "\n".join(lines) + "\n"
