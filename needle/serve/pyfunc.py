"""A needle model as an MLflow ``python_function`` model: save, log, and find its weights again.

The model is logged as code (``python_model`` = needle/serve/pyfunc_model.py, MLflow's "models
from code"), so loading it unpickles nothing: the weights (orbax), config and tokenizer
(``tokenizer.json``, or Needle 3's ``tokenizer.model``) travel as the artifact ``model``, the ``needle`` package itself as code
(``code_paths``), with a signature, an input example and pinned pip requirements.

The artifact lies at the root of the MLflow model (its ``MLmodel`` entry points at ``.``), so a
registered version is at once an MLflow model and an exported needle model directory:
``needle.registry.resolve_model_dir`` and ``needle.model.io.load_model`` read it as before.

    from needle.serve.pyfunc import log_pyfunc_to_run
    log_pyfunc_to_run(MlflowClient(), run_id, "runs/tuned/model")     # artifact path "model"
    mlflow.pyfunc.load_model("models:/needle@champion").predict(
        pd.DataFrame({"query": ["text Bob hi"], "tools": [json.dumps(tools)]}))

    mlflow models serve -m models:/needle@champion --env-manager local --port 5001

``local_model_dir(location)`` maps a directory or ``models:/`` URI to the needle model
directory (also for a pyfunc model saved with its weights under ``artifacts/``).
"""

from __future__ import annotations

import json
from importlib import metadata
from pathlib import Path
from typing import Any

import needle

from needle.registry import resolve_model_dir
from needle.serve.requests import PROTOCOL_KEYS

CODE_FILE = Path(__file__).with_name("pyfunc_model.py")
ARTIFACT = "model"
# What the model's code imports, pinned to this environment's versions.
REQUIREMENTS = ("mlflow", "jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy", "pandas", "tokenizers",
                "llguidance", "jsonschema", "pydantic", "jinja2", "regex", "safetensors", "datasets",
                "sentencepiece")  # fmt: skip
EXAMPLE_TOOLS = [
    {"name": "send_message", "description": "Send a text message",
     "parameters": {"type": "object", "properties": {"contact": {"type": "string"}, "text": {"type": "string"}},
                    "required": ["contact", "text"]}},
]  # fmt: skip


def pip_requirements() -> list[str]:
    """``name==version`` of each requirement installed here (names not installed are left out)."""
    pins = []
    for name in REQUIREMENTS:
        try:
            pins.append(f"{name}=={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            continue
    return pins


def input_example() -> Any:
    import pandas as pd

    return pd.DataFrame({"query": ["Text Bob that dinner is at 8"], "tools": [json.dumps(EXAMPLE_TOOLS)]})


def signature() -> Any:
    """Table in (``query`` or ``messages``, ``tools`` JSON string), table out (``calls`` JSON string,
    ``content``, ``error``); param ``constrained``. The chat shape bypasses it (``needle.serve.requests``)."""
    from mlflow.models.signature import ModelSignature
    from mlflow.types.schema import AnyType, Array, ColSpec, ParamSchema, ParamSpec, Schema

    # ``messages`` (a conversation: its messages carry tool_calls, tool results, null contents) and
    # ``tools`` (a JSON string in the table shape, a list in the chat shape) are AnyType; the chat
    # shape's ``tool_choice`` and OpenAI fields (``max_tokens``, ``stop``, ``temperature``…) are
    # declared so that MLflow passes them through (it drops undeclared keys), AnyType so that
    # needle.serve.requests checks them and names a bad one.
    return ModelSignature(
        inputs=Schema([ColSpec("string", "query", required=False), ColSpec(AnyType(), "tools", required=False),
                       ColSpec(Array(AnyType()), "messages", required=False),
                       ColSpec(AnyType(), "tool_choice", required=False),
                       *(ColSpec(AnyType(), key, required=False) for key in PROTOCOL_KEYS)]),  # fmt: skip
        outputs=Schema([ColSpec("string", "calls", required=False), ColSpec("string", "content", required=False),
                        ColSpec("string", "error", required=False)]),  # fmt: skip
        params=ParamSchema([ParamSpec("constrained", "boolean", True)]),
    )


def _kwargs(model_dir: str | Path) -> dict[str, Any]:
    path = Path(model_dir)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path}: not an exported needle model directory")
    return dict(
        python_model=str(CODE_FILE),
        artifacts={ARTIFACT: str(path)},
        code_paths=[str(Path(needle.__file__).parent)],
        signature=signature(),
        input_example=input_example(),
        pip_requirements=pip_requirements(),
    )


def save_pyfunc(model_dir: str | Path, path: str | Path) -> Path:
    """Write the pyfunc model of ``model_dir`` to directory ``path`` (must not exist)."""
    import shutil

    import mlflow.pyfunc
    from mlflow.models import Model

    root = Path(path)
    mlflow.pyfunc.save_model(path=str(root), **_kwargs(model_dir))
    # Lift the weights to the model's root (see the module doc) and point the artifact there.
    spec = Model.load(str(root / "MLmodel"))
    entry = spec.flavors["python_function"]["artifacts"][ARTIFACT]
    saved = root / entry["path"]
    for item in saved.iterdir():
        if (root / item.name).exists():
            raise FileExistsError(f"{root / item.name}: the model directory and the MLflow files clash")
        shutil.move(str(item), str(root / item.name))
    shutil.rmtree(root / "artifacts")
    entry["path"] = "."
    spec.save(str(root / "MLmodel"))
    return root


def log_pyfunc_to_run(client: Any, run_id: str, model_dir: str | Path, artifact_path: str = ARTIFACT) -> None:
    """Save the pyfunc model locally and upload it as ``artifact_path`` of run ``run_id`` (no active run needed).

    The files land exactly at ``<run artifact_uri>/<artifact_path>``, where
    ``needle.registry.register_version`` creates the version from.
    """
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        local = save_pyfunc(model_dir, Path(tmp) / artifact_path)
        client.log_artifacts(run_id, str(local), artifact_path)


def weights_dir(directory: str | Path) -> Path:
    """The needle model directory inside a pyfunc model directory, or ``directory`` itself."""
    root = Path(directory)
    mlmodel = root / "MLmodel"
    if not mlmodel.is_file():
        return root
    import yaml

    spec = yaml.safe_load(mlmodel.read_text(encoding="utf-8")) or {}
    artifacts = (spec.get("flavors", {}).get("python_function", {}).get("artifacts") or {})
    rel = (artifacts.get(ARTIFACT) or {}).get("path", f"artifacts/{ARTIFACT}")
    return root / rel


def local_model_dir(location: str) -> str:
    """A local needle model directory for a directory or ``models:/`` URI (pyfunc versions included)."""
    return str(weights_dir(resolve_model_dir(location)))
