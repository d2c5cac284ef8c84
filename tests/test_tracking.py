"""MlflowTracker against a throwaway SQLite store: batching, redaction, truncation, status."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from needle.tracking.mlflow_tracker import MlflowTracker
from needle.tracking.redaction import MAX_PARAM_VALUE_CHARS, REDACTED, TRUNCATED_TAG, is_secret_key
from needle.tracking.tracker import NoopTracker, Tracker


@pytest.fixture(scope="module")
def mlflow_store(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """One SQLite store per module: creating its schema costs seconds."""
    from mlflow.tracking import MlflowClient

    root = tmp_path_factory.mktemp("mlflow")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    exp = MlflowClient(tracking_uri=uri).create_experiment("t", artifact_location=(root / "art").as_uri())
    return uri, exp


@pytest.fixture()
def mlflow_run(mlflow_store: tuple[str, str]) -> tuple[str, str]:
    from mlflow.tracking import MlflowClient

    uri, exp = mlflow_store
    return uri, MlflowClient(tracking_uri=uri).create_run(exp).info.run_id


def test_protocol_is_satisfied() -> None:
    assert isinstance(NoopTracker(), Tracker)


@pytest.mark.parametrize(
    "key, secret",
    [
        ("hf_token", True),
        ("api-key", True),
        ("db.password", True),
        ("apiKey", True),
        ("client_secret", True),
        ("eval.max_new_tokens", False),
        ("train.keep_checkpoints", False),
        ("model.vocab_size", False),
        ("monkey", False),
    ],
)
def test_is_secret_key(key: str, secret: bool) -> None:
    assert is_secret_key(key) is secret


def test_metrics_are_batched_with_steps(mlflow_run: tuple[str, str]) -> None:
    uri, run_id = mlflow_run
    tracker = MlflowTracker(run_id, uri, flush_every=1000, flush_seconds=1e9)
    for step in range(0, 50, 10):
        tracker.log_metrics({"loss": 5.0 - step / 10, "lr": 1e-3}, step=step)
    # Nothing sent yet: the buffer has not reached flush_every.
    assert tracker.client.get_metric_history(run_id, "loss") == []
    tracker.finish()
    history = tracker.client.get_metric_history(run_id, "loss")
    assert [m.step for m in sorted(history, key=lambda m: m.step)] == [0, 10, 20, 30, 40]
    assert min(m.value for m in history) == pytest.approx(1.0)


def test_flush_every_sends_without_finish(mlflow_run: tuple[str, str]) -> None:
    uri, run_id = mlflow_run
    tracker = MlflowTracker(run_id, uri, flush_every=4, flush_seconds=1e9)
    tracker.log_metrics({"a": 1.0, "b": 2.0}, step=1)
    tracker.log_metrics({"a": 1.5, "b": 2.5}, step=2)
    # The background sender delivers a full buffer by itself; no finish or flush is called.
    deadline = time.monotonic() + 30
    while len(tracker.client.get_metric_history(run_id, "a")) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(tracker.client.get_metric_history(run_id, "a")) == 2
    assert tracker.pending == 0


def test_params_redacted_and_truncated_with_note(mlflow_run: tuple[str, str]) -> None:
    uri, run_id = mlflow_run
    tracker = MlflowTracker(run_id, uri)
    tracker.log_params({"lora.rank": 8, "hf_token": "hf_abc123", "long": "x" * 7000})
    tracker.set_tags({"backend": "cpu", "service_password": "hunter2"})
    tracker.finish()
    run = tracker.client.get_run(run_id)
    assert run.data.params["lora.rank"] == "8"
    assert run.data.params["hf_token"] == REDACTED
    assert len(run.data.params["long"]) == MAX_PARAM_VALUE_CHARS
    assert run.data.tags[TRUNCATED_TAG] == "long"
    assert run.data.tags["backend"] == "cpu"
    assert run.data.tags["service_password"] == REDACTED


def test_finish_marks_status(mlflow_run: tuple[str, str]) -> None:
    uri, run_id = mlflow_run
    tracker = MlflowTracker(run_id, uri)
    tracker.log_metrics({"loss": float("nan")}, step=3)
    tracker.finish("FAILED")
    assert tracker.client.get_run(run_id).info.status == "FAILED"
    assert len(tracker.client.get_metric_history(run_id, "loss")) == 1


def test_log_artifact_file_and_dir(mlflow_run: tuple[str, str], tmp_path: Path) -> None:
    uri, run_id = mlflow_run
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "report.json").write_text("{}")
    tracker = MlflowTracker(run_id, uri)
    tracker.log_artifact(tmp_path / "model", "model")
    tracker.log_artifact(tmp_path / "report.json")
    names = {f.path for f in tracker.client.list_artifacts(run_id)}
    assert names == {"model", "report.json"}
    assert [f.path for f in tracker.client.list_artifacts(run_id, "model")] == ["model/config.json"]


def test_dataset_inputs_are_logged_with_their_declared_schema_and_no_warning(tmp_path: Path) -> None:
    """MLflow infers a dataset's schema from rows and warns about each integer column; the
    prepared splits' schema comes from their features (``length`` an integer, no hint printed)."""
    import json
    import warnings
    from types import SimpleNamespace

    import datasets
    from mlflow.tracking import MlflowClient

    from needle_flows.run_record import log_dataset

    features = datasets.Features({"ids": datasets.Sequence(datasets.Value("int32")), "length": datasets.Value("int32"),
                                  **{k: datasets.Value("string") for k in ("query", "tools", "answers", "source")}})
    table = datasets.Dataset.from_dict({"ids": [[1, 2]], "length": [2], "query": ["q"], "tools": ["[]"],
                                        "answers": ["[]"], "source": ["s"]}, features=features)  # fmt: skip
    prepared = SimpleNamespace(splits={"train": table, "val": table, "test": table}, fingerprint="f" * 64)
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    run = client.create_run(client.create_experiment("d", artifact_location=(tmp_path / "a").as_uri()))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        log_dataset(run.info.run_id, prepared, "data/new.jsonl", client)
    assert [str(w.message)[:80] for w in seen if issubclass(w.category, (UserWarning, FutureWarning))] == []
    inputs = client.get_run(run.info.run_id).inputs.dataset_inputs
    assert len(inputs) == 3
    schema = json.loads(inputs[0].dataset.schema)["mlflow_colspec"]
    assert {"type": "integer", "name": "length", "required": True} in schema
