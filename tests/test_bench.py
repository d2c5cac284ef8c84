"""The benchmark: FLOP formulas, target verdicts, and the --quick smoke run's JSON keys."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.flops import flops_per_token
from bench.report import evaluate_targets

REPO = Path(__file__).resolve().parents[1]


def test_lora_flops_count_frozen_weights_without_weight_gradients() -> None:
    full = flops_per_token(1000, 0, n_layers=2, d_model=8, vocab=16, seq_len=4, mode="full")
    lora = flops_per_token(1000, 100, n_layers=2, d_model=8, vocab=16, seq_len=4, mode="lora")
    assert full["weights"] == 6000 and lora["weights"] == 4000 + 600
    assert full["attention"] == lora["attention"] == 6 * 2 * 4 * 8
    assert full["output"] == 6 * 8 * 16 and lora["output"] == 4 * 8 * 16
    assert lora["total"] == lora["weights"] + lora["attention"] + lora["output"]
    with pytest.raises(ValueError, match="unknown mode"):
        flops_per_token(1, 0, 1, 1, 1, 1, "prefix")


def test_random_params_have_the_models_tree_and_train_from_zero_adapters() -> None:
    import jax
    import numpy as np

    from bench.accelerator import random_params
    from needle.config import LoraConfig, model_preset
    from needle.hardware import settings_for
    from needle.model import lora as lora_lib

    cfg, lora_cfg, settings = model_preset("tiny"), LoraConfig(rank=4), settings_for("cpu", 2)
    params = random_params(cfg, lora_cfg, settings, seed=3)
    reference = lora_lib.init_params(cfg, lora_cfg, 3, settings)
    assert jax.tree.structure(params) == jax.tree.structure(reference)
    for (path, got), want in zip(jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(reference)):
        assert got.shape == want.shape and got.dtype == want.dtype, path
        name = str(path[-1].key)
        if name == "lora_b":  # the adapters start as the identity, as the model's init makes them
            assert not np.asarray(got).any()
        elif got.ndim >= 2:
            assert 0.01 < float(np.asarray(got).std()) < 0.03, path
    # distinct leaves of one shape get distinct draws
    assert not np.array_equal(np.asarray(params["block_0"]["attn"]["q_proj"]["kernel"]),
                              np.asarray(params["block_1"]["attn"]["q_proj"]["kernel"]))


def test_accelerator_cases_carry_their_own_settings() -> None:
    from bench.accelerator import parse_variant, split_cases

    cases = split_cases("135m-lora-16x1024,135m-lora-16x1024|attention=blocked,layers=2,0.6b-full-16x2048|remat=none")
    assert cases == ["135m-lora-16x1024", "135m-lora-16x1024|attention=blocked,layers=2", "0.6b-full-16x2048|remat=none"]
    assert parse_variant(cases[1]) == ("135m-lora-16x1024", {"attention": "blocked", "layers": 2})
    assert parse_variant(cases[0]) == ("135m-lora-16x1024", {})
    with pytest.raises(ValueError, match="FIELD=VALUE"):
        parse_variant("135m-lora-16x1024|blocked")


def test_accelerator_case_cut_to_fewer_layers_runs_and_records_its_depth(tmp_path: Path) -> None:
    import json

    from bench import accelerator

    out = tmp_path / "acc.json"
    assert accelerator.main(["--cases", "135m-lora-1x128|layers=1,loss_chunk=64", "--steps", "1", "--out", str(out)]) == 0
    (rec,) = json.loads(out.read_text())["cases"]
    assert "error" not in rec, rec
    assert rec["n_layers"] == 1 and rec["variant"] == "135m-lora-1x128|layers=1,loss_chunk=64"
    assert rec["settings"]["loss_chunk"] == 64 and rec["step_s"] > 0


def test_main_job_runs_the_flows_default_configs(tmp_path: Path) -> None:
    from bench import main_job
    from needle_flows.params import FinetuneParams

    flow = FinetuneParams(preset=main_job.PRESET)  # what `needle finetune ... --preset small --base auto` runs
    ours = main_job.job_configs(tmp_path, None, None, None)
    cacheless = lambda c: c.model_copy(update={"compilation_cache_dir": None})  # noqa: E731 - ours is per state
    train, optim = flow.training_configs()
    assert cacheless(ours["train"]) == cacheless(train) and ours["optim"] == optim
    assert ours["train"].compilation_cache_dir == str(tmp_path / "jax-cache")
    auto = flow.auto_base()
    assert ours["auto"].model == auto.model and ours["auto"].optim == auto.optim
    assert cacheless(ours["auto"].train) == cacheless(auto.train)
    assert ours["auto"].data.model_copy(update={"source": ""}) == auto.data.model_copy(update={"source": ""})
    assert Path(ours["auto"].data.source).resolve() == (REPO / flow.base_data).resolve() == main_job.BASE_DATA
    assert main_job.DATA == (REPO / flow.data).resolve() and ours["lora"] == flow.lora and ours["eval"] == flow.eval
    result = {"device_kind": "cpu", "backend": "cpu", "times": {"base_s": 1.25}, "total_s": 1.25,
              "comparison": {"exact_match": {"base": 0.5, "tuned": None}, "val_loss": None}}
    assert main_job.format_result(result).splitlines() == [
        "cpu (cpu): base_s 1.2; total 1.2 s", "  exact_match                      base   0.500  tuned       -"]


def test_targets_pass_miss_and_unmeasured() -> None:
    result = {"train": {"small_lora": {"utilisation": 0.31}, "medium_lora": {"utilisation": 0.2}},
              "compile": {"warm_over_cold": 0.5}, "pipeline": {"mlflow_logging_share": 0.001}}
    verdicts = {t["name"]: t["verdict"] for t in evaluate_targets(result)}
    assert verdicts["utilisation.small_lora"] == "pass"
    assert verdicts["utilisation.medium_lora"] == "miss"
    assert verdicts["compile.warm_over_cold"] == "miss"
    assert verdicts["pipeline.mlflow_logging_share"] == "pass"
    assert verdicts["cactus.wall_ratio"] == "n/a"


def test_packed_batches_count_real_tokens_and_rows_by_segment() -> None:
    import numpy as np

    from bench.steps import batch_tokens, row_lengths

    seg = np.array([[1, 1, 1, 2, 2, 0], [1, 1, 1, 1, 1, 1]], dtype=np.int32)
    packed = {"inputs": np.where(seg > 0, 7, 0).astype(np.int32), "segment_ids": seg}
    assert batch_tokens(packed, pad_id=0) == (12, 11)
    assert sorted(row_lengths(packed, pad_id=0)) == [2, 3, 6]
    plain = {"inputs": np.array([[5, 5, 0], [5, 0, 0]], dtype=np.int32)}
    assert batch_tokens(plain, pad_id=0) == (6, 3) and row_lengths(plain, pad_id=0) == [2, 1]
    verdicts = {t["name"]: t["verdict"] for t in evaluate_targets(
        {"train": {"small_lora": {"packing_efficiency": 0.97, "compiled_shapes": 1}}})}
    assert verdicts["train.small_lora.packing_efficiency"] == "pass"
    assert verdicts["train.small_lora.compiled_shapes"] == "pass"


@pytest.mark.slow
def test_quick_run_writes_documented_keys(tmp_path: Path) -> None:
    out = tmp_path / "latest.json"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-m", "bench.run", "--quick", "--skip-cactus", "--out", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    for key in ("schema_version", "machine", "peak", "train", "compile", "needle_style", "cactus",
                "data_eval", "pipeline", "devices", "targets"):
        assert key in result, key
    assert result["peak"]["f32"]["gflops"] > 0
    run = result["train"]["tiny_lora"]
    assert run["status"] == "ok", run
    assert run["padded_tokens_per_s"] >= run["real_tokens_per_s"] > 0
    assert 0 < run["utilisation"] and run["flops_per_token"]["total"] > 0
    assert result["cactus"] == {"status": "skipped", "reason": "--skip-cactus"}
    assert "peak f32 matmul" in done.stdout


def _write_trace(path: Path, events: list[dict]) -> None:
    import gzip

    path.write_bytes(gzip.compress(json.dumps({"traceEvents": events}).encode()))


def test_trace_summary_sums_device_ops_by_name(tmp_path: Path) -> None:
    from bench.trace import summarise

    meta = [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:TPU:0"}},
        {"ph": "M", "pid": 1, "tid": 2, "name": "thread_name", "args": {"name": "XLA Ops"}},
        {"ph": "M", "pid": 1, "tid": 3, "name": "thread_name", "args": {"name": "XLA Modules"}},
        {"ph": "M", "pid": 9, "name": "process_name", "args": {"name": "/host:CPU"}},
        {"ph": "M", "pid": 9, "tid": 1, "name": "thread_name", "args": {"name": "python"}},
    ]
    ops = [
        {"ph": "X", "pid": 1, "tid": 2, "ts": 0, "dur": 3000, "name": "fusion.1", "args": {"long_name": "dot"}},
        {"ph": "X", "pid": 1, "tid": 2, "ts": 3000, "dur": 1000, "name": "copy.2"},
        {"ph": "X", "pid": 1, "tid": 2, "ts": 5000, "dur": 3000, "name": "fusion.1"},
        {"ph": "X", "pid": 1, "tid": 3, "ts": 0, "dur": 8000, "name": "jit_train_step"},
        {"ph": "X", "pid": 9, "tid": 1, "ts": 0, "dur": 99000, "name": "host work"},  # not device time
    ]
    _write_trace(tmp_path / "perfetto_trace.json.gz", meta + ops)
    s = summarise(tmp_path / "perfetto_trace.json.gz")
    assert s["device_busy_ms"] == pytest.approx(7.0)
    assert s["span_ms"] == pytest.approx(8.0)
    assert s["ops"][0][:3] == ["fusion.1", 2, pytest.approx(6.0)]
    assert s["ops"][0][4] == "long_name=dot"
    assert s["modules"] == [["jit_train_step", 1, pytest.approx(8.0)]]


def test_trace_summary_reads_a_real_cpu_trace(tmp_path: Path) -> None:
    import jax
    import jax.numpy as jnp

    from bench.trace import main

    f = jax.jit(lambda x: jnp.tanh(x @ x).sum())
    x = jnp.ones((128, 128))
    f(x).block_until_ready()
    with jax.profiler.trace(str(tmp_path), create_perfetto_trace=True):
        f(x).block_until_ready()
    out = tmp_path / "summary.json"
    assert main([str(tmp_path), "--json", str(out)]) == 0
    (summary,) = json.loads(out.read_text())
    assert summary["n_ops"] > 0 and summary["device_busy_ms"] > 0


def test_attention_bench_times_what_the_backend_runs_and_reports_the_rest(tmp_path: Path) -> None:
    """On the CPU the tiled path is timed and checked against itself; the Pallas kernels, which
    need a TPU, are reported as errors, not left out."""
    from bench.attention import main

    out = tmp_path / "attention.json"
    assert main(["--rows", "1", "--seq", "256", "--paths", "tiled128,flash128", "--repeats", "1", "--layers", "2",
                 "--out", str(out)]) == 0  # fmt: skip
    paths = json.loads(out.read_text())["paths"]
    tiled = paths["tiled128"]
    assert tiled["fwd_ms"] > 0 and tiled["fwd_bwd_ms"] > 0 and tiled["step_ms"] == 2 * tiled["fwd_bwd_ms"]
    assert tiled["out_max_diff"] == 0 and tiled["against"] == "tiled128"
    assert "interpret" in paths["flash128"]["error"]
    with pytest.raises(SystemExit):
        main(["--paths", "flash"])  # no block size
