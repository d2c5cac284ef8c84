"""Backend probe and the per-backend settings, in one place.

``probe()`` reports what JAX will run on (``jax.default_backend().lower()``: gpu, metal, tpu
or cpu; ``JAX_PLATFORMS`` overrides). ``settings_for(backend)`` is the only place that maps a
backend to compute dtype, fused attention, rematerialisation policy, attention path, loss
chunking, micro-batching and layer-loop unrolling; ``with_overrides(settings, train_cfg)`` applies
a run's ``TrainConfig.remat`` / ``attention`` / ``loss_chunk`` / ``micro_batch_tokens`` over those
defaults.

Defaults per backend (why: the CPU is memory- and bandwidth-bound on a 2-core, 24 GB box;
accelerators have memory to spare for small models and want the fused kernels):

=========  ==========================  =========  ==========  ===========  ===========================
backend    remat                       attention  loss_chunk  micro-batch  layers
=========  ==========================  =========  ==========  ===========  ===========================
cpu        recompute                   blocked    256         off          scanned from 8 layers
gpu/cuda   auto                        auto       1024        off          scanned
tpu        auto                        auto       1024        4096 tokens  scanned
metal      none                        blocked    256         off          unrolled
=========  ==========================  =========  ==========  ===========  ===========================

A TPU's micro-batches keep 8192 tokens where a decoder's heads are narrower than 128 (they take
the tiled attention path, not splash; ``settings_for_model``); Needle 3 keeps 4096.

``remat="none"``, ``attention="dense"`` and ``loss_chunk=0`` are the code paths before issue 20
(no rematerialisation, full ``[B,H,T,T]`` scores, full ``[B,T,V]`` logits), kept selectable.

    python -m needle.cli probe [--json]
"""

from __future__ import annotations

import os
import platform
import sys
from dataclasses import asdict, dataclass
from typing import Any

GPU_BACKENDS = frozenset({"gpu", "cuda", "rocm"})

# Rematerialisation policies: "none" saves every activation (no remat), "everything" recomputes
# each block's forward in the backward pass (saves only block inputs); any other name is one of
# ``jax.checkpoint_policies`` (what may be saved), e.g. "dots_saveable".
REMAT_POLICIES = (
    "none", "everything", "dots_saveable", "dots_with_no_batch_dims_saveable", "nothing_saveable",
    "everything_saveable", "checkpoint_dots", "checkpoint_dots_with_no_batch_dims",
    "recompute",  # keep each block's input only, recompute in a custom VJP (model/recompute.py)
    # keep the MLP's gate and up outputs and the residual between attention and MLP, recompute the
    # attention half (q/k/v projections, attention's forward): the MLP's matmuls are most of a block's
    "mlp_saveable",
    # keep every projection's output (a LoRA adapter's added in) and LoRA's rank-wide x·A: what
    # dots_with_no_batch_dims_saveable keeps without LoRA, without its second copy under LoRA
    "projections_saveable",
    # the most the batch's activations fit in the device memory the train state leaves:
    # projections_saveable, else mlp_saveable, else nothing_saveable
    # (needle/model/decoder/scan.py resolve_remat)
    "auto",
)  # fmt: skip
# "dense": one [B,H,T,T] float32 score tensor per layer (the old path); "blocked": query blocks
# (needle/model/decoder/attention.py), never the full score matrix; "auto": cuDNN's fused kernel through
# jax.nn.dot_product_attention where it serves (NVIDIA GPU, half precision, no soft cap, no
# packing), blocked everywhere else.
# "splash": Pallas splash attention (needle/model/decoder/splash.py), what "auto" takes on a TPU for the
# shapes it accepts with heads of 128 or wider (narrower: blocked); asked for elsewhere it runs in the
# Pallas interpreter (tests).
# "flash": needle's own Pallas kernel for packed rows (needle/model/decoder/flash.py: causal, segment
# ids, any head width; no sliding window or soft cap), only when asked for; off a TPU interpreted.
ATTENTION_PATHS = ("auto", "blocked", "dense", "splash", "flash")


def prepare_platform_env() -> None:
    """Set environment that must exist before jax initialises (call before importing jax).

    On macOS the Metal PJRT plugin needs ``ENABLE_PJRT_COMPATIBILITY=1``; it is harmless
    elsewhere, so we only set it on Darwin and never override a user's value.
    """
    if sys.platform == "darwin":
        os.environ.setdefault("ENABLE_PJRT_COMPATIBILITY", "1")
    os.environ["XLA_FLAGS"] = cpu_xla_flags(os.environ.get("XLA_FLAGS", ""))


# XLA's CPU scheduler defaults to maximising concurrency, which hoists rematerialised forward
# work of every layer to the start of the backward pass and defeats remat (measured on the
# 135M Llama shape, 12 layers: 2.9 -> 1.8 GB of temporaries). The memory-minimising scheduler
# keeps remat's savings; on 2 cores the lost concurrency is negligible.
_CPU_SCHEDULER_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler=false"


def cpu_xla_flags(existing: str = "") -> str:
    """``existing`` XLA_FLAGS plus the CPU scheduler flag above, unless the user set that flag."""
    if "xla_cpu_enable_concurrency_optimized_scheduler" in existing:
        return existing
    return f"{existing} {_CPU_SCHEDULER_FLAG}".strip()


@dataclass(frozen=True)
class BackendSettings:
    """How the model computes on one backend."""

    backend: str
    compute_dtype: str  # activations and matmuls; master weights stay float32
    param_dtype: str  # stored (master) weights
    fused_attention: bool  # use jax.nn.dot_product_attention's fused path
    remat: str  # per-block rematerialisation policy (REMAT_POLICIES); "none": off
    scan_layers: bool  # the blocks as one lax.scan over the layer pattern's period (False: unrolled loop)
    attention: str = "blocked"  # ATTENTION_PATHS
    loss_chunk: int = 256  # tokens per chunk of the output layer + cross-entropy; 0: full [B,T,V] logits
    # the step halves its batch into micro-batches (gradients summed in one step, same result)
    # while each would still hold at least this many tokens; 0: only TrainConfig.grad_accum's split
    micro_batch_tokens: int = 0
    # the chunked loss skips a chunk without loss tokens (a conditional per chunk): on the CPU
    # prompt-only chunks of 256 are common; on an accelerator a 1024-token chunk of packed rows
    # nearly always holds answer tokens, and the conditional copied the head's [V, D] gradient
    # through each chunk (Qwen3-0.6B full on a TPU v5e, 2026-12-07)
    loss_skip_empty: bool = True
    # dtype of the residual stream between blocks (what the backward pass keeps per layer): float32
    # on the CPU; bfloat16 on accelerators, where it halves the activations a long batch holds
    residual_dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"remat policy {self.remat!r}; choose one of {list(REMAT_POLICIES)}")
        if self.attention not in ATTENTION_PATHS:
            raise ValueError(f"attention {self.attention!r}; choose one of {list(ATTENTION_PATHS)}")
        if self.loss_chunk < 0:
            raise ValueError(f"loss_chunk must be >= 0, got {self.loss_chunk}")
        if self.micro_batch_tokens < 0:
            raise ValueError(f"micro_batch_tokens must be >= 0, got {self.micro_batch_tokens}")

    @property
    def rematerialises(self) -> bool:
        """Whether blocks are rematerialised at all."""
        return self.remat not in ("none", "everything_saveable")


# On the CPU a model this deep runs its layers as one scan: unrolled, XLA compiles every layer on
# its own (the 135M Llama shape's 30 layers, LoRA at 2 x 2048 on the 2-core CPU, 2026-12-06: lower
# and compile 170 s unrolled, 16 s scanned, the same step time and loss). Shallower models (the
# tiny/small/medium presets the main job and the tests use) compile in seconds unrolled and stay so.
CPU_SCAN_MIN_LAYERS = 8


# "auto" attention on a TPU takes the splash kernel for heads at least this wide, else the tiled
# XLA path (needle/model/decoder/block.py Attention._splash).
SPLASH_MIN_HEAD_DIM = 128


def _tpu_micro_batch_tokens(head_dim: int | None) -> int:
    """The least tokens a TPU micro-batch keeps: 4096 for splash-width heads, 8192 for narrower ones.

    On a TPU v5e at 16 x 1024 (2026-12-07, bench/results/tpu-2026-12-07c and -07d): Qwen3-0.6B
    (head_dim 128, splash) LoRA ran 504 / 494 ms a step in 4 / 8 micro-batches, and before splash's
    residuals were kept 721 / 580 / 533 / 518 in 1 / 2 / 4 / 8 (in 2 remat auto no longer keeps
    every projection); its full fine-tuning 647 ms in 4, before 762 / 676 / 715 in 1 / 4 / 8; the
    135M Llama shape (head_dim 64, the tiled path, whose key-tile loops run once per
    micro-batch) LoRA 201 / 169 / 177 / 196 ms in 1 / 2 / 4 / 8, full 186 / 181 / 198 ms in 1 / 2 / 4.
    """
    # By width, not by the path a batch takes: a sequence that is not a multiple of 128, or an
    # attention path a run forces (TrainConfig.attention), takes tiled or splash regardless.
    return 8192 if head_dim is not None and head_dim < SPLASH_MIN_HEAD_DIM else 4096


def settings_for(backend: str, n_layers: int | None = None, head_dim: int | None = None) -> BackendSettings:
    """Return the compute settings for a backend name as reported by the probe; with the model's
    ``n_layers``, a CPU scans the layers of a model of ``CPU_SCAN_MIN_LAYERS`` or more; with its
    ``head_dim``, a TPU sizes micro-batches for the attention path the heads take."""
    b = backend.lower()
    if b == "metal":
        # The Metal plugin lacks fused attention and handles remat and scanned loops poorly.
        return BackendSettings(b, "float32", "float32", fused_attention=False, remat="none", scan_layers=False,
                               attention="blocked", loss_chunk=256)  # fmt: skip
    if b in GPU_BACKENDS or b == "tpu":
        # Keep the projections' outputs where they fit (remat auto), else each block's input.
        # A GPU keeps whole batches until measured; a TPU micro-batches (_tpu_micro_batch_tokens).
        micro = _tpu_micro_batch_tokens(head_dim) if b == "tpu" else 0
        return BackendSettings(b, "bfloat16", "float32", fused_attention=True, remat="auto",
                               scan_layers=True, attention="auto", loss_chunk=1024,
                               micro_batch_tokens=micro, loss_skip_empty=False,
                               residual_dtype="bfloat16")  # fmt: skip
    # CPU and anything unknown: float32; keep only each block's input and recompute the block in
    # the backward pass (model/recompute.py: jax.checkpoint's policies do not hold on XLA's CPU
    # pipeline), logits in chunks of 256 tokens. 135M Llama shape, LoRA 4x640, 2026-12-04: peak
    # RSS 2.53 GB at 127.6 tokens/s, against 6.24 GB at 128.8 under dots_with_no_batch_dims_saveable.
    return BackendSettings(b, "float32", "float32", fused_attention=False,
                           remat="recompute", scan_layers=(n_layers or 0) >= CPU_SCAN_MIN_LAYERS,
                           attention="blocked", loss_chunk=256)  # fmt: skip


def settings_for_model(backend: str, cfg: Any) -> BackendSettings:
    """``settings_for`` a model config's depth and head width; Needle 3 (``arch="needle3"``) attends
    through ``jax.nn.dot_product_attention`` at any width, so the width rule leaves it alone."""
    head_dim = None if getattr(cfg, "arch", None) == "needle3" else cfg.head_dim
    return settings_for(backend, cfg.n_layers, head_dim)


def with_overrides(settings: BackendSettings, train_cfg: Any = None, **overrides: Any) -> BackendSettings:
    """``settings`` with a run's choices: ``train_cfg.remat`` / ``.attention`` / ``.loss_chunk`` /
    ``.scan_layers`` / ``.micro_batch_tokens`` (None keeps the backend default), then explicit
    keyword overrides of the same names (None keeps)."""
    from dataclasses import replace

    picked: dict[str, Any] = {}
    for key in ("remat", "attention", "loss_chunk", "scan_layers", "micro_batch_tokens"):
        value = overrides.get(key)
        if value is None and train_cfg is not None:
            value = getattr(train_cfg, key, None)
        if value is not None:
            picked[key] = value
    return replace(settings, **picked) if picked else settings


def old_paths(settings: BackendSettings) -> BackendSettings:
    """The code paths before issue 20 on this backend: no remat, dense attention, full logits."""
    return with_overrides(settings, remat="none", attention="dense", loss_chunk=0, micro_batch_tokens=0)


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
    micro = "off"
    if s["micro_batch_tokens"]:
        micro = f"of >= {s['micro_batch_tokens']} tokens (8192 for a decoder's heads under 128)"
    lines.append(
        f"Settings: compute {s['compute_dtype']}, params {s['param_dtype']}, "
        f"fused attention {'on' if s['fused_attention'] else 'off'}, remat {s['remat']}, "
        f"attention {s['attention']}, loss chunk {s['loss_chunk'] or 'off'}, "
        f"micro-batches {micro}"
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
