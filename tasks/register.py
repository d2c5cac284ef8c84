"""Prefect task: a new version of registered model `needle` from the run's `model` artifact.

MLflow's ``register_model("runs:/<id>/model")`` fails on a plain artifact directory (it expects
an MLflow-format model), so the version is created from the artifact URI directly.
"""

from typing import Any, Optional

from prefect import task
from prefect.cache_policies import NO_CACHE

MODEL_NAME = "needle"
CHAMPION = "champion"


def _is_better(new: Optional[float], old: Optional[str]) -> bool:
    """Champion rule: higher primary metric wins; a missing metric never replaces a known one."""
    if old is None or old in ("", "None"):
        return True
    return new is not None and new >= float(old)


@task(name="register", cache_policy=NO_CACHE)
def register(
    run_id: str,
    tracking_uri: Optional[str],
    metrics: dict[str, Any],
    primary_metric: str = "exact_match",
    name: str = MODEL_NAME,
) -> dict[str, Any]:
    """Create a model version with eval metrics as tags; move alias `champion` if it is no worse."""
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
    version = client.create_model_version(
        name, source=f"{run.info.artifact_uri}/model", run_id=run_id, tags=tags
    ).version
    try:
        current = client.get_model_version_by_alias(name, CHAMPION)
        old = current.tags.get(primary_metric)
    except MlflowException:
        old = None
    champion = _is_better(metrics.get(primary_metric), old)
    if champion:
        client.set_registered_model_alias(name, CHAMPION, version)
    return {"name": name, "version": str(version), "champion": champion}
