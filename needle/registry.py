"""The model registry: the champion rule, new versions, and registered models as local directories.

The pipeline registers each tuned model's exported directory as a version of MLflow model
``needle`` (``register_version``) and moves alias ``champion`` to it when
``decide_registration`` says it is no worse; ``needle predict`` and ``needle evaluate`` accept
``models:/needle/3`` or ``models:/needle@champion`` as well as a directory. MLflow is imported
only inside the functions that talk to it, so the core stays usable without it.

    from needle.registry import resolve_model_dir
    model_dir = resolve_model_dir("models:/needle@champion")   # needs MLFLOW_TRACKING_URI
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from needle.errors import NeedleError

MODEL_NAME = "needle"
CHAMPION = "champion"
PRIMARY_METRIC = "exact_match"
_URI = re.compile(r"^models:/(?P<name>[^/@]+)(?:/(?P<version>\d+)|@(?P<alias>[\w-]+))/?$")


def is_registry_uri(location: str) -> bool:
    """True for ``models:/...`` URIs."""
    return location.startswith("models:/")


def default_cache_dir() -> Path:
    """Where downloaded versions are kept: ``$NEEDLE_CACHE_DIR`` or ``~/.cache/needle/models``."""
    return Path(os.environ.get("NEEDLE_CACHE_DIR", Path.home() / ".cache" / "needle")) / "models"


def resolve_model_dir(location: str, cache_dir: str | Path | None = None) -> str:
    """A local model directory for a directory path or a ``models:/`` URI (downloaded once per version)."""
    if not is_registry_uri(location):
        return location
    match = _URI.match(location)
    if match is None:
        raise NeedleError(f"{location}: expected models:/<name>/<version> or models:/<name>@<alias>")
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    name = match["name"]
    client = MlflowClient()
    try:
        mv = (client.get_model_version(name, match["version"]) if match["version"]
              else client.get_model_version_by_alias(name, match["alias"]))
    except MlflowException as exc:
        raise NeedleError(f"{location}: not in the registry at {client.tracking_uri}: {exc.message}") from None
    # Versions are immutable, so a finished download is reused; a partial one never is.
    target = Path(cache_dir or default_cache_dir()) / name / str(mv.version)
    done = target / ".complete"
    if not done.exists():
        import mlflow.artifacts

        target.mkdir(parents=True, exist_ok=True)
        local = mlflow.artifacts.download_artifacts(artifact_uri=mv.source, dst_path=str(target))
        done.write_text(local)
    return done.read_text()


@dataclass(frozen=True)
class Registration:
    """The champion rule's verdict on a candidate."""

    champion: bool
    metric: str
    candidate: float | None
    incumbent: float | None


def decide_registration(
    candidate: dict[str, Any], incumbent: dict[str, Any] | None, metric: str = PRIMARY_METRIC
) -> Registration:
    """Champion rule: the candidate becomes champion when its ``metric`` is no worse than the
    incumbent's; with no incumbent (or one without the metric) it always does, and a candidate
    without the metric never replaces a known value."""
    new = candidate.get(metric)
    raw = (incumbent or {}).get(metric)
    old = None if raw in (None, "", "None") else float(raw)
    champion = old is None or (new is not None and float(new) >= old)
    return Registration(champion, metric, None if new is None else float(new), old)


def register_version(
    run_id: str, tracking_uri: str | None, metrics: dict[str, Any], name: str = MODEL_NAME
) -> dict[str, Any]:
    """A new version of ``name`` from the run's ``model`` artifact, with the eval metrics as
    tags; alias ``champion`` moves to it when :func:`decide_registration` says so.

    MLflow's ``register_model("runs:/<id>/model")`` fails on a plain artifact directory (it
    expects an MLflow-format model), so the version is created from the artifact URI directly.
    """
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    run = client.get_run(run_id)
    if not any(f.path == "model" for f in client.list_artifacts(run_id)):
        raise RuntimeError(f"run {run_id} has no 'model' artifact to register")
    try:
        client.get_registered_model(name)
    except MlflowException:
        client.create_registered_model(name, description="needle tool-calling models, one version per flow run")
    tags = {k: str(v) for k, v in metrics.items() if isinstance(v, (int, float, str, type(None)))}
    version = client.create_model_version(name, source=f"{run.info.artifact_uri}/model", run_id=run_id, tags=tags).version
    try:
        incumbent = dict(client.get_model_version_by_alias(name, CHAMPION).tags)
    except MlflowException:
        incumbent = None
    decision = decide_registration(metrics, incumbent)
    if decision.champion:
        client.set_registered_model_alias(name, CHAMPION, version)
    return {"name": name, "version": str(version), "champion": decision.champion}
