"""The model registry: versions, aliases ``champion``/``challenger``, and versions as local directories.

The flow registers each tuned model's exported directory as a version of MLflow model
``needle`` (``register_version``) after the gate (``needle.gate``) has scored it and the
champion on the same gate set: alias ``champion`` moves to a challenger that wins, a loser gets
alias ``challenger`` (the last model that lost). Every version carries its lineage and gate
scores as tags (``train_key``, ``data_digest``, ``gate_fingerprint``, ``gate.<metric>``, ...);
``unchanged_version`` finds the champion or challenger trained from the same inputs, which a
retrain then skips. ``needle predict`` and ``needle evaluate`` accept ``models:/needle/3`` or
``models:/needle@champion`` as well as a directory. MLflow is imported only inside the
functions that talk to it, so the core stays usable without it.

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
CHALLENGER = "challenger"
TRAIN_KEY = "train_key"  # version tag: the inputs key (needle.lineage.inputs_key) it was trained from
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
    """One number against one number: the candidate wins when its ``metric`` is no worse than
    the incumbent's; with no incumbent (or one without the metric) it always does, and a
    candidate without the metric never replaces a known value. Only meaningful for two scores
    on the same rows: the flow's champion rule is ``needle.gate.decide`` on the gate set."""
    new = candidate.get(metric)
    raw = (incumbent or {}).get(metric)
    old = None if raw in (None, "", "None") else float(raw)
    champion = old is None or (new is not None and float(new) >= old)
    return Registration(champion, metric, None if new is None else float(new), old)


def _client(tracking_uri: str | None) -> Any:
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=tracking_uri)


def alias_version(tracking_uri: str | None, alias: str, name: str = MODEL_NAME) -> Any | None:
    """The model version behind ``alias`` (an MLflow ``ModelVersion``), or None."""
    from mlflow.exceptions import MlflowException

    try:
        return _client(tracking_uri).get_model_version_by_alias(name, alias)
    except MlflowException:
        return None


def unchanged_version(tracking_uri: str | None, train_key: str, name: str = MODEL_NAME) -> tuple[str, Any] | None:
    """``(alias, version)`` of the champion, else the challenger, trained from inputs ``train_key``:
    a retrain on them would build that model again. None when neither was."""
    for alias in (CHAMPION, CHALLENGER):
        mv = alias_version(tracking_uri, alias, name)
        if mv is not None and mv.tags.get(TRAIN_KEY) == train_key:
            return alias, mv
    return None


def _tag_values(tags: dict[str, Any]) -> dict[str, str]:
    return {k: str(v)[:5000] for k, v in tags.items() if isinstance(v, (int, float, str, bool, type(None)))}


def register_version(
    run_id: str, tracking_uri: str | None, tags: dict[str, Any], promote: bool, name: str = MODEL_NAME,
    champion_version: str | None = None, champion_tags: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A new version of ``name`` from the run's ``model`` artifact with ``tags`` (lineage, gate
    scores, decision); alias ``champion`` moves to it when ``promote``, else it takes alias
    ``challenger``. ``champion_tags`` (its scores on this run's gate) go on ``champion_version``.

    MLflow's ``register_model("runs:/<id>/model")`` fails on a plain artifact directory (it
    expects an MLflow-format model), so the version is created from the artifact URI directly.
    """
    from mlflow.exceptions import MlflowException

    client = _client(tracking_uri)
    run = client.get_run(run_id)
    if not any(f.path == "model" for f in client.list_artifacts(run_id)):
        raise RuntimeError(f"run {run_id} has no 'model' artifact to register")
    try:
        client.get_registered_model(name)
    except MlflowException:
        client.create_registered_model(name, description="needle tool-calling models, one version per flow run")
    version = str(client.create_model_version(name, source=f"{run.info.artifact_uri}/model", run_id=run_id,
                                              tags=_tag_values(tags)).version)  # fmt: skip
    client.set_registered_model_alias(name, CHAMPION if promote else CHALLENGER, version)
    if champion_version and champion_tags:
        for key, value in _tag_values(champion_tags).items():
            client.set_model_version_tag(name, champion_version, key, value)
    return {"name": name, "version": version, "champion": promote, "alias": CHAMPION if promote else CHALLENGER}
