"""Backend probe and per-backend settings."""

import json
import os
import subprocess
import sys

import pytest

from needle.config import TrainConfig
from needle.hardware import CPU_SCAN_MIN_LAYERS, format_probe, probe, settings_for, settings_for_model, with_overrides


def test_probe_reports_cpu_here():
    info = probe()
    assert info["backend"] == "cpu"
    assert info["accelerated"] is False
    assert info["device_count"] == len(info["devices"]) >= 1
    assert info["devices"][0]["platform"] == "cpu"
    for key in ("jax_version", "jaxlib_version", "flax_version", "process_index", "process_count",
                "local_device_count"):
        assert key in info
    assert "Running on CPU: fine-tuning will be slower" in format_probe(info)


@pytest.mark.parametrize(
    "backend,dtype,fused,unrolled",
    [("cpu", "float32", False, True), ("gpu", "bfloat16", True, False),
     ("cuda", "bfloat16", True, False), ("rocm", "bfloat16", True, False),
     ("tpu", "bfloat16", True, False), ("metal", "float32", False, True)],
)
def test_settings_per_backend(backend, dtype, fused, unrolled):
    s = settings_for(backend)
    assert s.compute_dtype == dtype
    assert s.param_dtype == "float32"  # master weights stay float32 everywhere
    assert s.fused_attention is fused
    assert s.scan_layers is (not unrolled)
    if backend == "metal":
        assert s.rematerialises is False
    # Accelerators run every loss chunk (no per-chunk conditional); only a TPU splits batches.
    assert s.loss_skip_empty is (dtype == "float32")
    assert s.micro_batch_tokens == (4096 if backend == "tpu" else 0)


def test_tpu_micro_batches_by_head_width():
    """Heads narrower than splash's 128 lanes (the tiled attention path) keep 8192-token micro-batches
    on a TPU, 128 and wider 4096; other backends keep whole batches at any width."""
    assert settings_for("tpu", 30, head_dim=64).micro_batch_tokens == 8192
    assert settings_for("tpu", 28, head_dim=128).micro_batch_tokens == 4096
    assert settings_for("tpu", 18, head_dim=256).micro_batch_tokens == 4096
    assert settings_for("gpu", 30, head_dim=64).micro_batch_tokens == 0
    assert settings_for("cpu", 30, head_dim=64).micro_batch_tokens == 0


def test_model_settings_by_family():
    """A decoder's head width reaches the rule; Needle 3 (dot_product_attention at any width, its
    default qk heads 48 wide) keeps the 4096-token micro-batches."""
    from needle.config import Needle3Config, model_preset
    from needle.model.needle3.checkpoint import needle3_model_config

    llama = model_preset("small")
    assert llama.head_dim < 128 and settings_for_model("tpu", llama).micro_batch_tokens == 8192
    wide = llama.model_copy(update={"head_dim": 128})
    assert settings_for_model("tpu", wide).micro_batch_tokens == 4096
    n3 = needle3_model_config(Needle3Config())
    assert n3.head_dim < 128 and settings_for_model("tpu", n3).micro_batch_tokens == 4096
    assert settings_for_model("cpu", llama) == settings_for("cpu", llama.n_layers)


def test_gpu_report_line():
    info = probe()
    info = {**info, "backend": "gpu", "accelerated": True,
            "settings": {**info["settings"], **settings_for("gpu").__dict__}}
    assert "GPU acceleration enabled for fine-tuning" in format_probe(info)


def test_cli_probe_json_honours_jax_platforms():
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-m", "needle.cli", "probe", "--json"], env=env,
                         capture_output=True, text=True, check=True).stdout
    info = json.loads(out)
    assert info["backend"] == "cpu" and info["jax_platforms"] == "cpu"
    for key in ("backend", "devices", "device_count", "accelerated", "jax_version"):
        assert key in info


def test_cpu_scans_the_layers_of_a_deep_model_unless_the_run_says_otherwise() -> None:
    assert settings_for("cpu").scan_layers is False
    assert settings_for("cpu", n_layers=CPU_SCAN_MIN_LAYERS - 1).scan_layers is False
    deep = settings_for("cpu", n_layers=30)
    assert deep.scan_layers is True
    assert with_overrides(deep, TrainConfig(mode="lora", scan_layers=False)).scan_layers is False
    assert settings_for("tpu", n_layers=2).scan_layers is True  # accelerators scan at any depth
