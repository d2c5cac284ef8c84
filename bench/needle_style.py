"""A LoRA training loop written the way cactus-needle's ``finetune_local`` is, on our model.

It reproduces the loop's costs, not its quirks of numerics (no CQ-W4 fake quantisation):

* adapters live in a side dict ``{path: {"A", "B"}}`` and every forward materialises
  ``W + scale·A·B`` for each targeted kernel (float32), then calls the plain model's ``apply``;
* every row is padded to one fixed length (the smallest power of two >= 128 that fits the
  longest row, capped at ``max_len``), never bucketed;
* ``float(loss)`` after every step: the host waits for the device each step;
* batches are ``order[start:start+batch]`` of a per-epoch permutation, so a ragged last batch
  has a new shape and recompiles the step;
* 10 % of the rows are held out first, as ``finetune_local`` does.

    from bench.needle_style import run_needle_style
    result = run_needle_style("small", prepared, tok, epochs=1)
"""

from __future__ import annotations

import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import traverse_util

from needle.config import model_preset
from needle.model.decoder.transformer import Transformer
from needle.model.io import load_model

from bench.fixtures import ensure_base

_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def fixed_length(lengths: list[int], cap: int) -> int:
    """finetune_local's ``fit_max_len``: a power of two from 128 up, capped."""
    bucket = 128
    while bucket < min(max(lengths), cap):
        bucket *= 2
    return min(bucket, cap)


def padded_arrays(prepared: Any, max_len: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """All rows (every split, file order) as ``[N, L]`` ids and loss masks padded to one length."""
    rows = [r for name in ("train", "val", "test") if name in prepared.splits for r in prepared.splits[name]]
    length = fixed_length([len(r["ids"]) for r in rows], max_len)
    ids = np.full((len(rows), length), pad_id, np.int32)
    mask = np.zeros((len(rows), length), np.float32)
    for i, r in enumerate(rows):
        n = min(len(r["ids"]), length)
        ids[i, :n] = r["ids"][:n]
        mask[i, :n] = r["loss_mask"][:n]
    return ids, mask


def init_side_lora(params: Any, rank: int, key: jax.Array) -> dict[tuple, dict[str, jax.Array]]:
    """finetune_local's ``init_lora``: A ~ N(0,1)/rank, B = 0, per targeted kernel."""
    lora = {}
    for path, w in traverse_util.flatten_dict(params).items():
        if path[-1] == "kernel" and any(t in path for t in _TARGETS):
            key, sub = jax.random.split(key)
            lora[path] = {"A": jax.random.normal(sub, (w.shape[0], rank), jnp.float32) / rank,
                          "B": jnp.zeros((rank, w.shape[1]), jnp.float32)}
    return lora


def merge_side_lora(params: Any, lora: dict, scale: float) -> Any:
    """``W + scale·A·B`` for every adapted kernel: the full matrix, built inside every step."""
    flat = dict(traverse_util.flatten_dict(params))
    for path, ad in lora.items():
        flat[path] = flat[path] + (scale * jnp.matmul(ad["A"], ad["B"])).astype(flat[path].dtype)
    return traverse_util.unflatten_dict(flat)


def run_needle_style(preset: str, prepared: Any, tok: Any, *, epochs: int = 1, batch_size: int = 16,
                     rank: int = 16, alpha: float = 32.0, lr: float = 1e-4, val_split: float = 0.1,
                     seed: int = 0, max_steps: int | None = None) -> dict[str, Any]:
    """Train adapters the Needle way; per-step wall times (each ends in a host sync)."""
    model_cfg = model_preset(preset)
    params = jax.device_put(load_model(ensure_base(preset, tok)).params)
    model = Transformer(model_cfg)  # no LoRA modules: adapters are merged into W instead
    seqs, masks = padded_arrays(prepared, model_cfg.max_len, tok.pad_id)
    rng = np.random.default_rng(seed)
    n_val = min(int(len(seqs) * val_split), len(seqs) - 1)
    order = rng.permutation(len(seqs))
    seqs, masks = seqs[order][n_val:], masks[order][n_val:]
    scale = alpha / rank
    lora = init_side_lora(params, rank, jax.random.PRNGKey(seed))
    count = len(seqs)
    total_steps = epochs * -(-count // batch_size)
    warmup = min(max(1, total_steps // 20), total_steps - 1)
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, total_steps)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule))
    opt_state = optimizer.init(lora)

    def loss_fn(lora: dict, ids: jax.Array, mask: jax.Array) -> jax.Array:
        logits = model.apply({"params": merge_side_lora(params, lora, scale)}, ids)
        logits, targets, mask = logits[:, :-1], ids[:, 1:], mask[:, 1:]
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
        return (ce * mask).sum() / jnp.maximum(mask.sum(), 1.0)

    @jax.jit
    def train_step(lora: dict, opt_state: Any, ids: jax.Array, mask: jax.Array) -> tuple:
        loss, grads = jax.value_and_grad(loss_fn)(lora, ids, mask)
        updates, opt_state = optimizer.update(grads, opt_state, lora)
        return optax.apply_updates(lora, updates), opt_state, loss

    times: list[float] = []
    shapes: list[int] = []
    padded = real = 0
    last = float("nan")
    t_start = time.perf_counter()
    for _ in range(epochs):
        perm = rng.permutation(count)
        for start in range(0, count, batch_size):
            if max_steps is not None and len(times) >= max_steps:
                break
            idx = perm[start:start + batch_size]
            t0 = time.perf_counter()
            lora, opt_state, loss = train_step(lora, opt_state, jnp.asarray(seqs[idx]), jnp.asarray(masks[idx]))
            last = float(loss)  # the per-step host sync of the original
            times.append(time.perf_counter() - t0)
            shapes.append(len(idx))
            padded += seqs[idx].size
            real += int((seqs[idx] != tok.pad_id).sum())
    wall = time.perf_counter() - t_start
    full = [t for i, (t, b) in enumerate(zip(times, shapes)) if i > 0 and b == batch_size]
    step_s = float(np.median(full)) if full else float("nan")
    ragged = [t for t, b in zip(times, shapes) if b != batch_size]
    n_lora = sum(int(a["A"].size + a["B"].size) for a in lora.values())
    return {
        "preset": preset, "rows_trained": count, "seq_len": int(seqs.shape[1]), "steps": len(times),
        "batch_size": batch_size, "n_lora": n_lora,
        "first_step_s": times[0] if times else None, "step_s": step_s,
        "ragged_step_s": ragged[0] if ragged else None,
        "padded_tokens_per_s": batch_size * seqs.shape[1] / step_s if full else None,
        "real_token_fraction": real / padded if padded else None,
        "real_tokens_per_s": (batch_size * seqs.shape[1] / step_s) * real / padded if full and padded else None,
        "wall_s": wall, "loss": last,
    }
