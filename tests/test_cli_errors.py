"""User mistakes on the command line: exit 2, one line on stderr, no traceback, --out untouched."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from needle_flows.cli import main

ROOT = Path(__file__).resolve().parents[1]
NEW = str(ROOT / "data/sample/new.jsonl")


def _tree(path: Path) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.fixture
def out_dir(tmp_path: Path) -> Path:
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("as it was")
    return out


def _cases(tmp_path: Path, out: Path) -> dict[str, tuple[list[str], str]]:
    a_file = tmp_path / "a_file.txt"
    a_file.write_text("x")
    tools_dir = tmp_path / "tools"
    tools_dir.mkdir()
    return {
        "lora without base": (["train", NEW, "--out", str(out)], "needs --base"),
        "steps 0": (["train", NEW, "--out", str(out), "--steps", "0"], "--steps: must be a positive integer"),
        "out is a file": (["train", NEW, "--out", str(a_file), "--mode", "scratch"], "is a file, not a directory"),
        "out under a file": (["train", NEW, "--out", f"{a_file}/o", "--mode", "scratch"], "is a file"),
        "base missing": (["train", NEW, "--out", str(out), "--base", "/nonexistent"], "no such model directory"),
        "scratch with base": (["train", NEW, "--out", str(out), "--mode", "scratch", "--base", str(out)], "do not pass --base"),
        "params not json": (["finetune", "x.jsonl", "--params", "not json"], "--params is not valid JSON"),
        "params a list": (["finetune", "x.jsonl", "--params", "[1,2]"], "must be a JSON object, got list"),
        "finetune steps 0": (["finetune", "x.jsonl", "--steps", "0"], "must be a positive integer"),
        "predict tools dir": (["predict", "/nonexistent", "--tools", str(tools_dir), "--query", "hi"], "is a directory"),
        "evaluate max-rows 0": (["evaluate", "/nonexistent", NEW, "--max-rows", "0"], "must be a positive integer"),
        "evaluate out is a file": (["evaluate", "/nonexistent", NEW, "--out", str(a_file)], "is a file, not a directory"),
        "unknown flag": (["train", NEW, "--out", str(out), "--stpes", "3"], "unrecognized arguments"),
        "train key unknown": (["train", NEW, "--out", str(out), "--mode", "scratch", "--train", '{"scan_layrs": true}'],
                              "--train/--optim: scan_layrs: Extra inputs are not permitted"),
        "optim not json": (["train", NEW, "--out", str(out), "--mode", "scratch", "--optim", "{lr: 1}"],
                           "--optim is not valid JSON"),
    }


CASES = ["lora without base", "steps 0", "out is a file", "out under a file", "base missing", "scratch with base",
         "params not json", "params a list", "finetune steps 0", "predict tools dir", "evaluate max-rows 0",
         "evaluate out is a file", "unknown flag", "train key unknown", "optim not json"]  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_mistake_exits_2_with_one_line(case: str, tmp_path: Path, out_dir: Path, capsys) -> None:
    argv, reason = _cases(tmp_path, out_dir)[case]
    before = _tree(tmp_path)
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and reason in err, err
    assert "Traceback" not in err
    assert _tree(tmp_path) == before and sorted(p.name for p in tmp_path.iterdir()) == ["a_file.txt", "out", "tools"]


def _run(args: list[str], stdin: bytes = b"", env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "needle_flows.cli", *args], input=stdin, capture_output=True, cwd=ROOT,
                          env={**os.environ, **(env or {})}, timeout=300)  # fmt: skip


def test_invalid_utf8_on_stdin_is_one_line(tmp_path: Path) -> None:
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps([{"name": "f", "parameters": {"type": "object", "properties": {}}}]))
    proc = _run(["predict", "/nonexistent", "--tools", str(tools)], stdin=b"fine\n\xff\xfe\n")
    err = proc.stderr.decode()
    assert proc.returncode == 2 and err.strip() == "error: stdin line 2 is not valid UTF-8 (byte 0xff)"


def test_misspelt_finetune_key_is_one_line_before_any_run(tmp_path: Path) -> None:
    proc = _run(["finetune", "x.jsonl", "--params", '{"lora": {"rnak": 4}}'], env={"NEEDLE_STATE_DIR": str(tmp_path)})
    err = proc.stderr.decode()
    assert proc.returncode == 2 and "Traceback" not in err, err
    assert err.strip().splitlines() == ["error: invalid parameters: lora.rnak: Extra inputs are not permitted"]
    assert not (tmp_path / "runs").exists()


def test_unreachable_tracking_server_is_one_line_in_seconds(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: nothing listens there
    proc = _run(["finetune", NEW, "--preset", "tiny"],
                env={"NEEDLE_STATE_DIR": str(tmp_path), "MLFLOW_TRACKING_URI": f"http://ann:pw9@127.0.0.1:{port}"})
    err = proc.stderr.decode()
    assert proc.returncode == 2 and "Traceback" not in err, err
    assert err.strip().splitlines() == [
        f"error: MLflow tracking server http://ann:***@127.0.0.1:{port} is not reachable (no answer within 5 s): "
        "start it, or unset MLFLOW_TRACKING_URI to track in the local SQLite store"]


def test_train_refused_for_other_data_leaves_out_as_it_was(tmp_path: Path) -> None:
    out, env = tmp_path / "out", {"NEEDLE_CACHE_DIR": str(tmp_path / "cache"), "JAX_PLATFORMS": "cpu"}
    first = _run(["train", NEW, "--mode", "scratch", "--preset", "tiny", "--steps", "2", "--out", str(out)], env=env)
    assert first.returncode == 0, first.stderr.decode()[-2000:]
    before = _tree(out)
    other = str(ROOT / "data" / "sample" / "base.jsonl")
    proc = _run(["train", other, "--mode", "scratch", "--preset", "tiny", "--steps", "2", "--out", str(out)], env=env)
    err = proc.stderr.decode()
    assert proc.returncode == 2 and "fingerprint" in err and "Traceback" not in err, err[-2000:]
    assert _tree(out) == before


def test_train_and_optim_json_set_what_the_flow_can(sample_data: dict[str, Path], tmp_path: Path, capsys) -> None:
    """`needle train --train/--optim` reach TrainConfig and OptimConfig as the flow's `train` and
    `optim` parameters do: the run takes their steps and batch size."""
    out = tmp_path / "out"
    argv = ["train", str(sample_data["new"]), "--out", str(out), "--mode", "scratch", "--preset", "tiny",
            "--train", '{"steps": 2, "batch_size": 4, "log_every": 1}', "--optim", '{"lr": 0.001, "warmup_steps": 0}']
    assert main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2
