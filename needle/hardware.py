"""Backend probe and the per-backend settings, in one place.

``probe()`` reports what JAX will run on (``jax.default_backend().lower()``: gpu, metal, tpu
or cpu; ``JAX_PLATFORMS`` overrides). ``settings_for(backend)`` is the only place that maps a
backend to compute dtype, fused attention, rematerialisation and layer-loop unrolling.

    python -m needle.cli probe [--json]
"""

from __future__ import annotations

import os
import platform
import sys
from dataclasses import asdict, dataclass
from typing import Any

GPU_BACKENDS = frozenset({"gpu", "cuda", "rocm"})


def prepare_platform_env() -> None:
    """Set environment that must exist before jax initialises (call before importing jax).

    On macOS the Metal PJRT plugin needs ``ENABLE_PJRT_COMPATIBILITY=1``; it is harmless
    elsewhere, so we only set it on Darwin and never override a user's value.
    """
    if sys.platform == "darwin":
        os.environ.setdefault("ENABLE_PJRT_COMPATIBILITY", "1")


@dataclass(frozen=True)
class BackendSettings:
    """How the model computes on one backend."""

    backend: str
    compute_dtype: str  # activations and matmuls; master weights stay float32
    param_dtype: str  # stored (master) weights
    fused_attention: bool  # use jax.nn.dot_product_attention's fused path
    remat: bool  # rematerialise each block in the backward pass (memory for compute)
    scan_layers: bool  # roll the layer loop with nn.scan (False: unrolled Python loop)


def settings_for(backend: str) -> BackendSettings:
    """Return the compute settings for a backend name as reported by the probe."""
    b = backend.lower()
    if b == "metal":
        # The Metal plugin lacks fused attention and handles remat and scanned loops poorly.
        return BackendSettings(b, "float32", "float32", fused_attention=False, remat=False, scan_layers=False)
    if b in GPU_BACKENDS:
        return BackendSettings(b, "bfloat16", "float32", fused_attention=True, remat=False, scan_layers=False)
    if b == "tpu":
        return BackendSettings(b, "bfloat16", "float32", fused_attention=True, remat=False, scan_layers=False)
    # CPU and anything unknown: plain float32, no tricks.
    return BackendSettings(b, "float32", "float32", fused_attention=False, remat=False, scan_layers=False)


def probe() -> dict[str, Any]:
    """Describe the JAX runtime: backend, devices, counts, versions, and acceleration."""
    prepare_platform_env()
    import jax
    import jaxlib

    try:
        import flax

        flax_version = flax.__version__
    except ImportError:  # pragma: no cover - flax is a hard dependency
        flax_version = None
    backend = jax.default_backend().lower()
    devices = [
        {"id": int(d.id), "platform": str(d.platform).lower(), "device_kind": str(d.device_kind)}
        for d in jax.devices()
    ]
    return {
        "backend": backend,
        "accelerated": backend != "cpu",
        "devices": devices,
        "device_count": jax.device_count(),
        "local_device_count": jax.local_device_count(),
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "device_kind": devices[0]["device_kind"] if devices else None,
        "jax_version": jax.__version__,
        "jaxlib_version": jaxlib.__version__,
        "flax_version": flax_version,
        "jax_platforms": os.environ.get("JAX_PLATFORMS"),
        "python_version": platform.python_version(),
        "settings": asdict(settings_for(backend)),
    }


def format_probe(info: dict[str, Any]) -> str:
    """Human report in the spirit of Needle's verification script."""
    lines = [
        f"JAX version: {info['jax_version']} (jaxlib {info['jaxlib_version']}, flax {info['flax_version']})",
        f"Default backend: {info['backend']}",
        f"JAX_PLATFORMS: {info['jax_platforms'] or '(unset)'}",
        f"Devices ({info['device_count']}, {info['local_device_count']} local, "
        f"process {info['process_index']}/{info['process_count']}):",
    ]
    for d in info["devices"]:
        lines.append(f"  [{d['id']}] {d['platform']}: {d['device_kind']}")
    s = info["settings"]
    lines.append(
        f"Settings: compute {s['compute_dtype']}, params {s['param_dtype']}, "
        f"fused attention {'on' if s['fused_attention'] else 'off'}, remat {'on' if s['remat'] else 'off'}"
    )
    if info["backend"] in GPU_BACKENDS:
        lines.append("GPU acceleration enabled for fine-tuning")
    elif info["accelerated"]:
        lines.append(f"{info['backend'].upper()} acceleration enabled for fine-tuning")
    else:
        lines.append("Running on CPU: fine-tuning will be slower")
    return "\n".join(lines)


def enable_compilation_cache(cache_dir: str | None) -> None:
    """Turn on JAX's persistent compilation cache so a rerun of the same shapes skips XLA."""
    if not cache_dir:
        return
    import jax

    os.makedirs(cache_dir, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", os.path.abspath(cache_dir))
    # Cache every compiled program: our CPU compiles are short but many.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
