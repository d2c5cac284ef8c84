"""Resolve a registered model (``models:/needle/3``, ``models:/needle@champion``) to a local directory.

The pipeline registers each tuned model's exported directory as a version of MLflow model
``needle``; ``needle predict`` and ``needle evaluate`` accept that URI as well as a directory.
MLflow is imported only when a ``models:/`` URI is given, so the core stays usable without it.

    from needle.registry import resolve_model_dir
    model_dir = resolve_model_dir("models:/needle@champion")   # needs MLFLOW_TRACKING_URI
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from needle.errors import NeedleError

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
