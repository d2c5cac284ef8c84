"""Shared state and deploys (issue 13, item 5): the auto-base lock, URI credentials redacted
wherever they are printed or stored, a refused resume leaves its folder as it was, and
prefect.yaml deploys from the checkout it is run in."""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import pytest

from needle import pipeline
from needle.config import DataConfig, model_preset, training_configs
from needle.errors import CheckpointMismatchError
from needle.tracking.redaction import RedactingFilter, redact_uri, sanitize_params
from needle.tracking.tracker import MemoryTracker

ROOT = Path(__file__).resolve().parents[1]
SECRET_URI = "http://user:secret@127.0.0.1:1"


def test_two_runs_wanting_the_same_auto_base_train_it_once(sample_data: dict[str, Path], tmp_path: Path) -> None:
    train, optim = training_configs("scratch", steps=2, batch_size=8)
    auto = pipeline.AutoBase(DataConfig(source=str(sample_data["base"])), model_preset("tiny"), train, optim)
    start, bases, errors = threading.Barrier(2), [], []

    def obtain() -> None:
        start.wait()
        try:
            bases.append(pipeline.obtain_base("auto", auto=auto, state_dir=tmp_path, tracker=MemoryTracker()))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=obtain) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not errors and len(bases) == 2
    assert sorted(b.cached for b in bases) == [False, True]  # trained once; the other waited and reused it
    assert bases[0].model_dir == bases[1].model_dir
    assert len(list((tmp_path / "base").glob("*/model"))) == 1


def test_redact_uri_hides_passwords_and_tokens_only() -> None:
    assert redact_uri(SECRET_URI) == "http://user:***@127.0.0.1:1"
    assert redact_uri("https://tok123@host/x") == "https://***@host/x"
    assert redact_uri("error: API request to http://u:p4ss@h:5000/api failed") == \
        "error: API request to http://u:***@h:5000/api failed"
    for plain in ("sqlite:////abs/mlflow.db", "http://127.0.0.1:5000/#/experiments/1", "file:///tmp/a", "hf:o/n@rev"):
        assert redact_uri(plain) == plain
    clean, _ = sanitize_params({"tracking": SECRET_URI, "data.source": "s3://k:v@bucket/x.jsonl"})
    assert "secret" not in str(clean) and "v@" not in str(clean)


def test_log_records_and_tracebacks_are_redacted() -> None:
    try:
        raise ConnectionError(f"cannot reach {SECRET_URI}/api")
    except ConnectionError as exc:
        record = logging.LogRecord("prefect.flow_runs", logging.ERROR, __file__, 1, "failed: %s", (exc,),
                                   exc_info=(type(exc), exc, exc.__traceback__))
    assert RedactingFilter().filter(record)
    text = logging.Formatter().format(record)
    assert "secret" not in text and "user:***@127.0.0.1:1" in text and "ConnectionError" in text


def test_flow_summary_result_and_cli_output_carry_no_password(capsys: pytest.CaptureFixture[str]) -> None:
    from needle_flows import cli
    from needle_flows import run_record as rec

    run = rec.MlflowRun(client=None, uri=SECRET_URI, experiment_id="1", experiment="needle-local", run_id="abc")
    markdown = rec.summary_markdown({**run.info, "status": "FAILED", "error": f"ConnectionError: {SECRET_URI}"})
    assert "secret" not in markdown and "user:***@127.0.0.1:1/#/experiments/1/runs/abc" in markdown
    cli._print_result({"tracking_uri": SECRET_URI, "run_id": "abc", "experiment_id": "1", "model_dir": "m"},
                      rec.ui_link)
    assert "secret" not in capsys.readouterr().out


def _snapshot(folder: Path) -> dict[str, tuple[bytes, int]]:
    return {str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()} | {".": (b"", folder.stat().st_mtime_ns)}


def test_a_refused_resume_leaves_the_output_folder_as_it_was(sample_data: dict[str, Path], tmp_path: Path) -> None:
    model = model_preset("tiny")
    out = tmp_path / "out"

    def run(weight_decay: float) -> Any:
        train, optim = training_configs("scratch", steps=2, batch_size=8, train={"checkpoint_every": 1},
                                        optim={"weight_decay": weight_decay})
        prepared = pipeline.prepare_data(DataConfig(source=str(sample_data["new"])), vocab_size=model.vocab_size,
                                         cache_dir=out / "data")
        return pipeline.train(prepared, model, train, optim, out_dir=out)

    run(0.01)
    before = {name: _snapshot(out / name) for name in ("data", "tokenizer", "checkpoints")}
    with pytest.raises(CheckpointMismatchError, match="optim.weight_decay"):
        run(0.02)
    assert {name: _snapshot(out / name) for name in before} == before


def test_after_a_divergence_a_lower_lr_resumes_from_the_last_good_checkpoint(
    sample_data: dict[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from needle.errors import NonFiniteLossError

    model, out = model_preset("tiny"), tmp_path / "out"
    prepared = pipeline.prepare_data(DataConfig(source=str(sample_data["new"])), vocab_size=model.vocab_size,
                                     cache_dir=tmp_path / "data")

    def run(lr: float) -> Any:
        train, optim = training_configs("scratch", steps=12, batch_size=8, train={"checkpoint_every": 2},
                                        optim={"lr": lr, "warmup_steps": 4, "clip_norm": 1e9})
        return pipeline.train(prepared, model, train, optim, out_dir=out)

    with pytest.raises(NonFiniteLossError, match="last good checkpoint: step"):
        run(1e5)  # diverges once the warmup has raised the rate
    kept = max(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit())
    assert kept < 12
    with caplog.at_level("WARNING", logger="needle"):
        resumed = run(1e-3)
    assert resumed.final_step == 12 and resumed.train_loss == resumed.train_loss  # finite
    assert "optim.lr changed from 100000.0 to 0.001" in caplog.text


def test_prefect_yaml_deploys_from_the_checkout_without_needle_checkout() -> None:
    import yaml

    text = (ROOT / "prefect.yaml").read_text()
    spec = yaml.safe_load(text)
    # No pull section: `prefect deploy` records set_working_directory(<the directory it ran in>).
    assert spec.get("pull") is None and all(d.get("pull") is None for d in spec["deployments"])
    assert "$NEEDLE_CHECKOUT" not in text
    assert "NEEDLE_CHECKOUT" not in (ROOT / "deployments" / "stack-up.sh").read_text()


def test_stale_run_rules() -> None:
    import socket
    import subprocess
    import sys
    import time

    from needle.tracking.mlflow_tracker import HEARTBEAT_TAG
    from needle_flows.run_record import HOST_TAG, PID_STARTED_TAG, PID_TAG, process_tags, run_is_stale

    now = time.time()
    assert run_is_stale(process_tags(), now) is None  # this very process
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    gone = {HOST_TAG: socket.gethostname(), PID_TAG: dead.stdout.strip(), PID_STARTED_TAG: "1.0"}
    assert "is gone" in run_is_stale(gone, now)
    reused = {**process_tags(), PID_STARTED_TAG: "1.0"}  # a live pid that started at another time
    assert "reused" in run_is_stale(reused, now)
    elsewhere = {HOST_TAG: "another-host", PID_TAG: "1"}
    assert "no heartbeat for 20 min" in run_is_stale({**elsewhere, HEARTBEAT_TAG: str(int(now - 1200))}, now)
    assert run_is_stale({**elsewhere, HEARTBEAT_TAG: str(int(now - 60))}, now) is None
    assert run_is_stale({}, now) is None  # not needle's: left alone
