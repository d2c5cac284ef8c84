"""The serving tests' fixtures: the eval tests' (sample rows, their tokenizer, a saved tiny model) and
``champion``, that model registered as ``needle@champion`` in a SQLite MLflow store."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("_eval_conftest", Path(__file__).parents[1] / "eval" / "conftest.py")
_eval = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
_spec.loader.exec_module(_eval)  # type: ignore[union-attr]

eval_rows = _eval.eval_rows
eval_tokenizer = _eval.eval_tokenizer
tiny_model_dir = _eval.tiny_model_dir


@pytest.fixture(scope="session")
def champion(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A SQLite MLflow store with the tiny model logged as pyfunc and registered as needle@champion."""
    from mlflow.tracking import MlflowClient

    from needle.serve.pyfunc import log_pyfunc_to_run

    root = tmp_path_factory.mktemp("mlflow")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("serve", artifact_location=(root / "artifacts").as_uri())
    run = client.create_run(exp)
    log_pyfunc_to_run(client, run.info.run_id, tiny_model_dir)
    client.set_terminated(run.info.run_id)
    client.create_registered_model("needle")
    # As needle.registry.register_version does: the version's source is <run artifacts>/model.
    mv = client.create_model_version("needle", f"{run.info.artifact_uri}/model", run_id=run.info.run_id)
    client.set_registered_model_alias("needle", "champion", mv.version)
    # The venv's bin first: `mlflow models serve` runs `uvicorn` from PATH.
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    env = {**os.environ, "PATH": path, "MLFLOW_TRACKING_URI": uri, "NEEDLE_CACHE_DIR": str(root / "cache")}
    return {"uri": uri, "root": str(root), "env": env}  # type: ignore[dict-item]
