"""Time the library's ``train_step`` on real batches: step time, tokens/s, FLOPs, input wait.

The step is the library's own (``needle.train.step.train_step`` jitted with the state donated,
exactly as ``needle.train.loop`` does); batches come from the library's own plan
(``needle.train.run.make_plans``: packed sequences of one length, unless ``packing=False``).

FLOPs are *useful model* FLOPs: real (non-padding) tokens only, and attention over each token's
own row (a packed row attends within its segment: the effective attention length is
``sum(n_i^2) / sum(n_i)`` over the rows ``i`` of a batch), so padding and the cross-row blocks of
a packed sequence's score matrix are never counted as work.
Steps are dispatched asynchronously and the host blocks once at the end of a timed window.

Input wait is measured as the difference between two timed windows of the same length: one
building each batch on the host inside the loop (as the library loop does), one feeding
batches that were built and put on the device beforehand. Their difference over the first
window's wall time is the share of wall time the device waited for input.
"""

from __future__ import annotations

import time
from typing import Any

import jax
import numpy as np

from needle.config import LoraConfig, OptimConfig, TrainConfig, model_preset
from needle.hardware import settings_for_model, with_overrides
from needle.model.lora import count_params
from needle.train.run import build_state as run_build_state
from needle.train.run import make_plans
from needle.train.step import train_step

from bench.flops import count_matmul_params, flops_per_token
from bench.fixtures import ensure_base

_jit_step_cache: dict[str, Any] = {}


def jitted_train_step() -> Any:
    """``jax.jit(train_step, donate_argnums=0)``, built once per process."""
    if "step" not in _jit_step_cache:
        _jit_step_cache["step"] = jax.jit(train_step, donate_argnums=0)
    return _jit_step_cache["step"]


def build_state(preset: str, mode: str, tok: Any, steps: int, batch_size: int, lora_rank: int = 16) -> tuple[Any, Any]:
    """A fresh ``TrainState`` for ``preset`` in ``mode`` on a random-init base; returns (state, model_cfg)."""
    train_cfg = TrainConfig(mode=mode, steps=steps, batch_size=batch_size, compilation_cache_dir=None)
    model_cfg = model_preset(preset)
    settings = with_overrides(settings_for_model(jax.default_backend(), model_cfg), train_cfg)  # as run_training does
    lora_cfg = LoraConfig(rank=lora_rank) if mode == "lora" else None
    base_dir = ensure_base(preset, tok) if mode in ("lora", "full") else None
    state, _ = run_build_state(model_cfg, train_cfg, OptimConfig(), lora_cfg, base_dir, settings)
    return state, model_cfg


def batch_tokens(batch: dict[str, np.ndarray], pad_id: int) -> tuple[int, int]:
    """(padded tokens B*T, real tokens = row positions) of one batch."""
    inputs = np.asarray(batch["inputs"])
    if "segment_ids" in batch:
        return int(inputs.size), int((np.asarray(batch["segment_ids"]) > 0).sum())
    return int(inputs.size), int((inputs != pad_id).sum())


def row_lengths(batch: dict[str, np.ndarray], pad_id: int) -> list[int]:
    """Lengths (positions) of the rows in one batch, packed or one per sequence."""
    if "segment_ids" in batch:
        seg = np.asarray(batch["segment_ids"])
        return [int(n) for r in seg for n in np.bincount(r)[1:] if n]
    return [int(n) for n in (np.asarray(batch["inputs"]) != pad_id).sum(axis=1) if n]


def run_window(state: Any, plan: Any, first: int, n: int, prebuilt: list | None = None) -> tuple[Any, float, float]:
    """Run steps ``first..first+n-1``; returns (state, wall seconds, last loss)."""
    step_fn = jitted_train_step()
    t0 = time.perf_counter()
    metrics = None
    for i in range(n):
        batch = prebuilt[i] if prebuilt is not None else plan.batch(first + i)
        state, metrics = step_fn(state, batch)
    jax.block_until_ready((state, metrics))
    wall = time.perf_counter() - t0
    return state, wall, float(metrics["loss"]) if metrics is not None else float("nan")


def make_plan(prepared: Any, tok: Any, model_cfg: Any, mode: str, batch_size: int, packing: bool = True) -> Any:
    """The training plan the library builds for these data (``make_plans``)."""
    train_cfg = TrainConfig(mode=mode, batch_size=batch_size, packing=packing, compilation_cache_dir=None)
    return make_plans(prepared, train_cfg, model_cfg.max_len, tok.pad_id, model_cfg)[0]


def measure_train(preset: str, mode: str, prepared: Any, tok: Any, *, steps: int = 20, batch_size: int = 16,
                  warmup: int = 3, lora_rank: int = 16, packing: bool = True) -> dict[str, Any]:
    """Compile, warm up, then time ``steps`` steps twice (host-built vs prebuilt batches)."""
    total = warmup + 2 * steps
    state, model_cfg = build_state(preset, mode, tok, total, batch_size, lora_rank)
    plan = make_plan(prepared, tok, model_cfg, mode, batch_size, packing)
    # LoRA splits the tree in two halves with disjoint leaves; count both and add.
    a, b = count_matmul_params(state.trainable), count_matmul_params(state.frozen)
    counts = {"n_mat": a["n_mat"] + b["n_mat"], "n_lora": a["n_lora"] + b["n_lora"]}

    t0 = time.perf_counter()
    state, first_s, _ = run_window(state, plan, 0, 1)
    seen = {np.shape(plan.batch(0)["inputs"])}
    # Warm up every bucket shape the timed windows will meet, so no compile lands in them.
    for i in range(1, warmup + 2 * steps):
        shape = np.shape(plan.batch(i)["inputs"])
        if shape not in seen:
            seen.add(shape)
            state, _, _ = run_window(state, plan, i, 1)
    state, _, _ = run_window(state, plan, 1, max(1, warmup - 1))
    warm_s = time.perf_counter() - t0

    first = warmup
    host_built = [plan.batch(first + i) for i in range(steps)]
    padded, real = map(sum, zip(*(batch_tokens(b, tok.pad_id) for b in host_built)))
    seq_lens = sorted({int(np.shape(b["inputs"])[1]) for b in host_built})
    t_host = time.perf_counter()
    _ = [plan.batch(first + i) for i in range(steps)]
    host_batch_s = (time.perf_counter() - t_host) / steps

    state, wall_a, loss = run_window(state, plan, first, steps)
    prebuilt = [jax.device_put(b) for b in host_built]
    jax.block_until_ready(prebuilt)
    state, wall_b, _ = run_window(state, plan, first, steps, prebuilt=prebuilt)

    step_s = wall_a / steps
    mean_t = padded / (batch_size * steps)
    rows = np.array([n for b in host_built for n in row_lengths(b, tok.pad_id)], dtype=np.float64)
    attn_len = float((rows**2).sum() / rows.sum())  # a token attends over its own row
    fl = flops_per_token(counts["n_mat"], counts["n_lora"], model_cfg.n_layers, model_cfg.d_model,
                         model_cfg.vocab_size, int(round(attn_len)), mode)
    return {
        "preset": preset, "mode": mode, "batch_size": batch_size, "steps_timed": steps,
        "packing": packing, "packing_efficiency": getattr(plan, "efficiency", None),
        "seq_lens": seq_lens, "mean_seq_len": mean_t, "attention_len": attn_len,
        "first_step_s": first_s, "warmup_s": warm_s, "compiled_shapes": len(seen),
        "step_s": step_s, "step_s_prebuilt": wall_b / steps,
        "padded_tokens_per_s": padded / wall_a, "real_tokens_per_s": real / wall_a,
        "real_token_fraction": real / padded,
        "n_mat": counts["n_mat"], "n_lora": counts["n_lora"],
        "n_params_total": count_params(state.trainable) + count_params(state.frozen),
        "n_params_trainable": count_params(state.trainable),
        "flops_per_token": fl, "achieved_gflops": fl["total"] * real / wall_a / 1e9,
        "host_batch_s": host_batch_s,
        "input_wait_share": max(0.0, wall_a - wall_b) / wall_a,
        "loss": loss,
    }
