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
