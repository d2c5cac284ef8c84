"""A Needle 3 base through the whole pipeline: the flow fine-tunes a single ``.safetensors``
checkpoint (its ``tokenizer.model`` beside it), registers a version whose run carries Needle's
exports, and ``needle serve`` of that version answers constrained calls. Bad Needle checkpoints
are refused with exit 2 (CLI) or a NeedleError (flow), and nothing is registered."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest
from flow_harness import flow_harness

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def flow_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with flow_harness(tmp_path_factory.mktemp("n3flow")) as uri:
        yield uri


@pytest.fixture(scope="module")
def needle3_file(tmp_path_factory: pytest.TempPathFactory, sample_data: dict[str, Path]) -> Path:
    """``tiny-needle3.safetensors`` with its ``tokenizer.model`` beside it (no repository layout)."""
    from needle.model.needle3.random_model import write_random_needle3

    root = tmp_path_factory.mktemp("n3base")
    repo = write_random_needle3(root / "repo", data=sample_data["new"], seed=0)
    ckpt = root / "tiny-needle3.safetensors"
    shutil.copyfile(repo / "checkpoints" / "needle3.safetensors", ckpt)
    shutil.copyfile(repo / "tokenizer" / "tokenizer.model", root / "tokenizer.model")
    return ckpt


def _params(tiny_flow_params: dict[str, Any], base: Path) -> dict[str, Any]:
    params = {k: v for k, v in tiny_flow_params.items() if k not in ("base_data", "base_steps", "preset")}
    return {**params, "base_model": str(base), "max_len": 1024, "batch_size": 4,
            "eval": {"max_rows": 2, "batch_size": 2, "max_new_tokens": 8}}  # fmt: skip


def _versions(uri: str) -> list[Any]:
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri).search_model_versions("name = 'needle'")


def test_flow_finetunes_needle3_registers_exports_and_serves(
    flow_env: str, tiny_flow_params: dict[str, Any], needle3_file: Path, tmp_path: Path
) -> None:
    import jsonschema
    from mlflow.tracking import MlflowClient

    from needle_flows.finetune import needle
    from needle_flows.params import FinetuneParams
    from needle.data.prepare import PreparedData
    from needle.model.io import load_model
    from needle.serve.pyfunc import EXAMPLE_TOOLS

    result = needle(FinetuneParams(**_params(tiny_flow_params, needle3_file)))
    client = MlflowClient(tracking_uri=flow_env)
    run = client.get_run(result["run_id"])
    assert run.info.status == "FINISHED"
    p = run.data.params
    assert p["model.arch"] == "needle3" and p["base_model.arch"] == "needle3"
    assert p["base_model.source"] == str(needle3_file) and p["lora.qat"] == "True"
    files = {Path(f.path).name for f in client.list_artifacts(run.info.run_id, "export/needle")}
    assert {"checkpoint.safetensors", "adapter.safetensors", "model.cact", "tokenizer.model"} <= files
    version = client.get_model_version("needle", result["model_version"]["version"])
    assert version.tags["export.needle"] == f"runs:/{run.info.run_id}/export/needle"
    tuned = load_model(result["model_dir"])
    assert tuned.model_cfg.arch == "needle3" and (Path(result["model_dir"]) / "tokenizer.model").is_file()
    # Rows were encoded in Needle's own format: BOS id first, the tools inside <tools>, EOS last.
    row = PreparedData.load(result["prepared_dir"]).splits["train"][0]
    assert row["ids"][0] == 2 and row["ids"][-1] == 1
    assert tuned.tokenizer.decode(row["ids"]).startswith("<|im_start|>user\n<tools>[")

    # `needle serve` of the registered champion answers constrained calls.
    sys.path.insert(0, str(Path(__file__).parent / "serve"))
    from serve_helpers import free_port, post, stop_group, wait_for_ping

    port, log_path = free_port(), tmp_path / "serve.log"
    env = {**os.environ, "MLFLOW_TRACKING_URI": flow_env, "NEEDLE_CACHE_DIR": str(tmp_path / "cache")}
    cmd = [sys.executable, "-m", "needle.cli", "serve", f"models:/needle/{result['model_version']['version']}",
           "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
    with open(log_path, "w") as log:
        server = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        base = f"http://127.0.0.1:{port}"
        try:
            wait_for_ping(server, base, log_path)
            tools = [{"type": "function", "function": t} for t in EXAMPLE_TOOLS]
            status, out = post(f"{base}/v1/chat/completions",
                                {"model": "needle", "messages": [{"role": "user", "content": "Text Bo hi"}], "tools": tools})
            assert status == 200, out
            message = out["choices"][0]["message"]  # type: ignore[index]
            for call in message.get("tool_calls") or []:
                assert call["function"]["name"] == "send_message"
                jsonschema.validate(json.loads(call["function"]["arguments"]), EXAMPLE_TOOLS[0]["parameters"])
            status, out = post(f"{base}/invocations",
                                {"dataframe_records": [{"query": "Text Bo hi", "tools": json.dumps(EXAMPLE_TOOLS)}]})
            assert status == 200 and out["predictions"][0]["error"] is None, out  # type: ignore[index]
            assert isinstance(json.loads(out["predictions"][0]["calls"]), list)  # type: ignore[index]
        finally:
            stop_group(server)


def _bad_checkpoints(good: Path, root: Path) -> dict[str, Path]:
    """Copies of a good Needle 3 checkpoint, each broken one way; tokenizer.model beside each."""
    from safetensors import safe_open
    from safetensors.numpy import load_file, save_file

    with safe_open(str(good), framework="np") as f:
        meta = dict(f.metadata())
    tensors = load_file(str(good))
    cfg = json.loads(meta["config"])
    out: dict[str, Path] = {}

    def write(name: str, tensors: dict[str, Any], metadata: dict[str, str]) -> None:
        out[name] = root / f"{name}.safetensors"
        save_file(tensors, str(out[name]), metadata=metadata)

    write("needle2", tensors, {**meta, "config": json.dumps({**{k: v for k, v in cfg.items() if k != "qk_head_dim"}, "attn_dim": 64})})
    write("no_config", tensors, {k: v for k, v in meta.items() if k != "config"})
    write("shapes", tensors, {**meta, "config": json.dumps({**cfg, "d_model": cfg["d_model"] * 2})})
    write("unknown_switch", tensors, {**meta, "config": json.dumps({**cfg, "moe_experts": 8})})
    out["truncated"] = root / "truncated.safetensors"
    out["truncated"].write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    out["pickle"] = root / "pickle.safetensors"
    out["pickle"].write_bytes(b"\x80\x04\x95" + b"\x00" * 64)  # a pickle stream under a .safetensors name
    shutil.copyfile(good.parent / "tokenizer.model", root / "tokenizer.model")
    return out


def test_bad_needle3_checkpoints_exit_2_and_register_nothing(
    flow_env: str, tiny_flow_params: dict[str, Any], needle3_file: Path, sample_data: dict[str, Path], tmp_path: Path
) -> None:
    from needle_flows.finetune import needle
    from needle_flows.params import FinetuneParams
    from needle.errors import NeedleError

    bad = _bad_checkpoints(needle3_file, tmp_path)
    expected = {"needle2": "Needle 2", "no_config": "config", "shapes": "shape", "unknown_switch": "moe_experts",
                "truncated": "truncated", "pickle": "pickle"}  # fmt: skip
    for name, path in bad.items():
        done = subprocess.run([sys.executable, "-m", "needle.cli", "train", str(sample_data["new"]), "--out",
                               str(tmp_path / f"out-{name}"), "--base", str(path), "--steps", "1"],
                              capture_output=True, text=True, timeout=300)  # fmt: skip
        assert done.returncode == 2, (name, done.stderr[-2000:])
        assert expected[name] in done.stderr and str(path) in done.stderr, (name, done.stderr[-2000:])
        assert "Traceback" not in done.stderr
    before = len(_versions(flow_env))
    with pytest.raises(NeedleError, match="Needle 2"):
        needle(FinetuneParams(**_params(tiny_flow_params, bad["needle2"])))
    assert len(_versions(flow_env)) == before
