"""The `needle` flow in-process (Prefect test harness, SQLite MLflow in tmp): a good run is fully
recorded and registered; a bad dataset fails with file:line, a FAILED run and no new version."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest
from flow_harness import flow_harness

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def flow_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A throwaway Prefect server, MLflow store and needle state dir; yields the tracking URI."""
    with flow_harness(tmp_path_factory.mktemp("flow")) as uri:
        yield uri


def _versions(uri: str) -> list[Any]:
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri).search_model_versions("name = 'needle'")


def test_flow_records_and_registers(flow_env: str, tiny_flow_params: dict[str, Any]) -> None:
    from mlflow.tracking import MlflowClient

    from needle_flows.finetune import needle
    from needle_flows.params import FinetuneParams

    result = needle(FinetuneParams(**tiny_flow_params))
    client = MlflowClient(tracking_uri=flow_env)
    run = client.get_run(result["run_id"])
    assert run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "needle-local"
    tags, params, metrics = run.data.tags, run.data.params, run.data.metrics
    assert tags["backend"] == "cpu" and tags["device_count"] == "1"
    assert tags["prefect.flow_run_id"] and tags["data_fingerprint"] and tags["git_commit"]
    assert params["lora.rank"] == "16" and params["model.preset"] == "tiny" and params["train.steps"] == "4"
    assert "optim.lr" in params and params["base/train.mode"] == "scratch"
    loss_steps = sorted(m.step for m in client.get_metric_history(run.info.run_id, "loss"))
    assert loss_steps == [1, 2, 3, 4]
    assert {"tuned_exact_match", "base_exact_match", "val_loss"} <= set(metrics)
    artifacts = {f.path for f in client.list_artifacts(run.info.run_id)}
    assert {"model", "tokenizer", "eval", "plots"} <= artifacts
    assert [f.path for f in client.list_artifacts(run.info.run_id, "plots")] == ["plots/loss.png"]
    assert run.inputs.dataset_inputs and run.inputs.dataset_inputs[0].dataset.digest
    (version,) = [v for v in _versions(flow_env) if v.run_id == run.info.run_id]
    assert version.tags["exact_match"] is not None
    assert result["model_version"]["version"] == str(version.version)


def test_rerun_on_cached_base_logs_the_same_keys(flow_env: str, tiny_flow_params: dict[str, Any]) -> None:
    """A second run reuses the base but records its params and curve, so runs compare key by key."""
    from mlflow.tracking import MlflowClient

    from needle_flows.finetune import needle
    from needle_flows.params import FinetuneParams

    result = needle(FinetuneParams(**{**tiny_flow_params, "lora": {"rank": 8}}))
    client = MlflowClient(tracking_uri=flow_env)
    second = client.get_run(result["run_id"])
    assert second.data.tags["base_cached"] == "True"
    exp = client.get_experiment_by_name("needle-local")
    (first,) = [r for r in client.search_runs([exp.experiment_id], "attributes.status = 'FINISHED'")
                if r.data.tags.get("base_cached") == "False"]
    assert set(second.data.params) == set(first.data.params)
    # system/* come from MLflow's sampling thread every 10 s: present or not by timing in a tiny run;
    # gate_champion_* exist once there is a champion to score (the first run had none).
    def trained(run: Any) -> set[str]:
        return {k for k in run.data.metrics if not k.startswith(("system/", "gate_champion_"))}

    assert trained(second) == trained(first)
    assert second.data.params["base/train.steps"] == first.data.params["base/train.steps"] == "4"
    assert second.data.params["lora.rank"] == "8"
    base_curve = [m.step for m in client.get_metric_history(second.info.run_id, "base/loss")]
    assert sorted(base_curve) == sorted(m.step for m in client.get_metric_history(first.info.run_id, "base/loss"))


def test_predict_from_registry_uri(
    flow_env: str, sample_data: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    """`needle predict models:/needle/<v>` downloads that version and answers like its directory."""
    import json

    from needle.cli import main
    from needle.registry import resolve_model_dir

    versions = _versions(flow_env)
    assert versions, "test_flow_records_and_registers registers a version first"
    latest = max(int(v.version) for v in versions)
    monkeypatch.setenv("NEEDLE_CACHE_DIR", str(tmp_path / "cache"))
    local = resolve_model_dir(f"models:/needle/{latest}")
    assert Path(local).is_relative_to(tmp_path / "cache")
    assert {"config.json", "tokenizer.json", "params"} <= {p.name for p in Path(local).iterdir()}

    row = json.loads(sample_data["new"].read_text().splitlines()[0])
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps(row["tools"]))
    printed = []
    for ckpt in (f"models:/needle/{latest}", local):
        assert main(["predict", ckpt, "--tools", str(tools), "--query", row["query"]]) == 0
        printed.append(capsys.readouterr().out)
    assert printed[0] == printed[1] and json.loads(printed[0])
    for bad in (f"models:/needle/{latest + 100}", "models:/needle"):
        assert main(["predict", bad, "--tools", str(tools), "--query", "x"]) == 2
        assert bad in capsys.readouterr().err


def test_bad_dataset_fails_without_registering(
    flow_env: str, tiny_flow_params: dict[str, Any], bad_data: Path, bad_line: int
) -> None:
    from mlflow.tracking import MlflowClient

    from needle_flows.finetune import needle
    from needle_flows.params import FinetuneParams
    from needle.errors import DataError

    before = len(_versions(flow_env))
    with pytest.raises(DataError, match=rf"{bad_data.name}:{bad_line}: "):
        needle(FinetuneParams(**{**tiny_flow_params, "data": str(bad_data)}))
    client = MlflowClient(tracking_uri=flow_env)
    exp = client.get_experiment_by_name("needle-local")
    (run,) = client.search_runs([exp.experiment_id], "attributes.status = 'FAILED'")
    assert f"{bad_data.name}:{bad_line}:" in run.data.tags["failure_reason"]
    assert len(_versions(flow_env)) == before


def _flat_params(model_dir: str | Path) -> dict[str, Any]:
    import jax
    import numpy as np

    from needle.model.io import load_model

    params = load_model(model_dir).params
    return {jax.tree_util.keystr(p): np.asarray(v) for p, v in jax.tree_util.tree_leaves_with_path(params)}


def _needle_train(data: Path, out: Path, *args: str) -> dict[str, Any]:
    import json

    from needle.cli import main

    assert main(["train", str(data), "--out", str(out), "--steps", "4", "--batch-size", "8", *args]) == 0
    return json.loads((out / "summary.json").read_text())


def test_needle_train_and_the_flow_give_bit_equal_params(
    flow_env: str, tiny_flow_params: dict[str, Any], sample_data: dict[str, Path], tmp_path: Path
) -> None:
    """One path: the library command and the flow train the same LoRA from the same base and data."""
    import numpy as np

    from needle_flows.finetune import needle
    from needle_flows.params import FinetuneParams

    base = _needle_train(sample_data["base"], tmp_path / "base", "--mode", "scratch", "--preset", "tiny")
    lib = _needle_train(sample_data["new"], tmp_path / "lora", "--mode", "lora", "--base", base["model_dir"])
    flow = needle(FinetuneParams(**{**tiny_flow_params, "base_model": base["model_dir"], "preset": None}))
    assert flow["data_fingerprint"] == lib["fingerprint"]
    ours, theirs = _flat_params(lib["model_dir"]), _flat_params(flow["model_dir"])
    assert ours.keys() == theirs.keys()
    assert all(np.array_equal(ours[k], theirs[k]) for k in ours)


@pytest.mark.own_process  # the flow starts a Ray driver in its process: conftest.py
def test_two_ray_workers_train_what_one_process_trains(
    flow_env: str, tiny_flow_params: dict[str, Any], sample_data: dict[str, Path], tmp_path: Path
) -> None:
    """`needle train --workers 2` and the flow's cluster parameter: LoRA on two Ray workers (a local
    Ray, started and stopped by each) gives the one-process weights (1e-5); the flow's run records
    both workers' devices and every step's loss."""
    import numpy as np
    from mlflow.tracking import MlflowClient

    from needle_flows.finetune import needle
    from needle_flows.params import FinetuneParams

    pytest.importorskip("ray")
    base = _needle_train(sample_data["base"], tmp_path / "base", "--mode", "scratch", "--preset", "tiny")
    one = _needle_train(sample_data["new"], tmp_path / "one", "--mode", "lora", "--base", base["model_dir"])
    two = _needle_train(sample_data["new"], tmp_path / "two", "--mode", "lora", "--base", base["model_dir"],
                        "--workers", "2")  # fmt: skip
    flow = needle(FinetuneParams(**{**tiny_flow_params, "base_model": base["model_dir"], "preset": None,
                                    "cluster": {"workers": 2}, "force": True}))  # fmt: skip
    ours = _flat_params(one["model_dir"])
    for model_dir in (two["model_dir"], flow["model_dir"]):
        theirs = _flat_params(model_dir)
        assert ours.keys() == theirs.keys()
        for k in ours:
            np.testing.assert_allclose(theirs[k], ours[k], atol=1e-5, err_msg=k)
    client = MlflowClient(tracking_uri=flow_env)
    run = client.get_run(flow["run_id"])
    assert run.info.status == "FINISHED" and run.data.params["devices"] == "2"
    assert run.data.params["cluster.workers"] == "2" and run.data.params["cluster.ray"] == "local"
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "loss")) == [1, 2, 3, 4]


def test_dropping_bad_rows_prepares_the_same_rows_on_both_paths(
    flow_env: str, tiny_flow_params: dict[str, Any], bad_data: Path, tmp_path: Path
) -> None:
    """on_error="drop" for a base trained from scratch: the library command and the flow's auto base."""
    from needle_flows.finetune import needle
    from needle_flows.params import FinetuneParams
    from needle.data.prepare import PreparedData

    lib = _needle_train(bad_data, tmp_path / "base", "--mode", "scratch", "--preset", "tiny", "--on-error", "drop")
    flow = needle(FinetuneParams(**{**tiny_flow_params, "base_data": str(bad_data), "on_error": "drop"}))
    assert flow["base"]["fingerprint"] == lib["fingerprint"] and lib["data_stats"]["dropped"] == 1
    ours, theirs = PreparedData.load(lib["prepared_dir"]), PreparedData.load(flow["base"]["prepared_dir"])
    for split in ("train", "val", "test"):
        assert ours.splits[split]["source"] == theirs.splits[split]["source"]
        assert ours.splits[split]["ids"] == theirs.splits[split]["ids"]


@pytest.fixture(scope="module")
def tiny_hf_models(tmp_path_factory: pytest.TempPathFactory, sample_data: dict[str, Path]) -> dict[str, Path]:
    """Tiny random Qwen3 and Gemma 3 models in hub layout, tokenizers trained on the sample rows."""
    from needle.model.hf.random_model import write_random_hf_model

    root = tmp_path_factory.mktemp("hf")
    return {arch: write_random_hf_model(root / arch, arch, data=sample_data["base"], vocab_size=512, d_model=32)
            for arch in ("qwen3", "gemma3_text")}  # fmt: skip


@pytest.mark.parametrize("arch", ["qwen3", "gemma3_text"])
def test_flow_finetunes_an_imported_hf_model(flow_env: str, tiny_flow_params: dict[str, Any],
                                             tiny_hf_models: dict[str, Path], arch: str) -> None:
    """LoRA on an imported model: its chat template, the same run record, HF and PEFT exports."""
    from mlflow.tracking import MlflowClient

    from needle_flows.finetune import needle
    from needle_flows.params import FinetuneParams
    from needle.model.io import load_model

    params = {k: v for k, v in tiny_flow_params.items() if k not in ("base_data", "base_steps", "preset")}
    result = needle(FinetuneParams(**{**params, "base_model": str(tiny_hf_models[arch]), "max_len": 1024,
                                      "batch_size": 4, "eval": {"max_rows": 2, "batch_size": 2, "max_new_tokens": 4}}))
    client = MlflowClient(tracking_uri=flow_env)
    run = client.get_run(result["run_id"])
    assert run.info.status == "FINISHED"
    p = run.data.params
    assert p["base_model.arch"] == arch and p["base_model.source"] == str(tiny_hf_models[arch])
    assert int(p["base_model.n_params"]) > 0 and p["model.arch"] == arch
    assert {f.path for f in client.list_artifacts(run.info.run_id, "export")} == {"export/hf", "export/peft"}
    peft_files = {Path(f.path).name for f in client.list_artifacts(run.info.run_id, "export/peft")}
    assert peft_files == {"adapter_config.json", "adapter_model.safetensors"}
    assert result["model_version"]["version"]
    tuned = load_model(result["model_dir"])
    assert tuned.tokenizer.chat_template and tuned.model_cfg.arch == arch
    # Rows were rendered with the model's own chat template, not needle's.
    from needle.data.prepare import PreparedData

    row = PreparedData.load(result["prepared_dir"]).splits["train"][0]
    text = tuned.tokenizer.decode(row["ids"])
    assert text.startswith({"qwen3": "<|im_start|>system", "gemma3_text": "<bos><start_of_turn>user"}[arch])
    assert "<|call|>" not in text


def _broken_models(good: Path, root: Path) -> dict[str, Path]:
    """Copies of a good HF model, each damaged one way a user's download or config can be."""
    import json
    import shutil

    out = {}
    for name in ("unsupported", "truncated", "vocab"):
        out[name] = Path(shutil.copytree(good, root / name))
    cfg = json.loads((good / "config.json").read_text())
    (out["unsupported"] / "config.json").write_text(json.dumps({**cfg, "model_type": "bert"}))
    weights = out["truncated"] / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    (out["vocab"] / "config.json").write_text(json.dumps({**cfg, "vocab_size": 64}))  # tokenizer has 512
    return out


def test_broken_hf_base_fails_before_training_without_registering(
    flow_env: str, tiny_flow_params: dict[str, Any], tiny_hf_models: dict[str, Path], tmp_path: Path
) -> None:
    from needle_flows.finetune import needle
    from needle_flows.params import FinetuneParams
    from needle.errors import NeedleError

    before = len(_versions(flow_env))
    expected = {"unsupported": "model_type 'bert' is not supported", "truncated": "model.safetensors",
                "vocab": "vocab"}  # fmt: skip
    for name, model_dir in _broken_models(tiny_hf_models["qwen3"], tmp_path).items():
        params = {k: v for k, v in tiny_flow_params.items() if k not in ("base_data", "base_steps", "preset")}
        with pytest.raises(NeedleError, match=expected[name]):
            needle(FinetuneParams(**{**params, "base_model": str(model_dir)}))
    assert len(_versions(flow_env)) == before
