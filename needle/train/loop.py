"""The training loop: jit once, never block per step, run hooks every N steps.

``train`` dispatches ``train_step`` asynchronously and keeps its metrics as device arrays;
every ``log_every`` steps (and whenever a hook is due, and at the end) it fetches them in one
transfer, stops with ``NonFiniteLossError`` on a NaN/inf loss (before any hook, so no
checkpoint of a bad state is written), then runs the hooks in order. Hooks are Levanter-style
callables ``fn(step, state, metrics) -> dict | None`` outside jit; a returned dict (e.g. the
validation loss) is merged into the step's metrics record for the hooks after it.

    result = train(state, plan, train_cfg, mesh=make_mesh(),
                   hooks=[metrics_hook(tracker_cb), checkpoint_hook(ckpt, meta, every=100)],
                   val_plan=val_plan)

The ``state`` passed in is donated to the first step: do not use it afterwards.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Protocol, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from needle.config import TrainConfig
from needle.errors import NonFiniteLossError
from needle.train.checkpoint import Checkpointer
from needle.train.sharding import replicate, shard_batch
from needle.train.step import TrainState, eval_step, train_step

log = logging.getLogger(__name__)

# Compiled once per process (per batch shape and state layout); the state is donated so the
# update happens in place.
_train_step = jax.jit(train_step, donate_argnums=0)
_eval_step = jax.jit(eval_step)

HookFn = Callable[[int, TrainState, dict[str, Any]], "dict[str, Any] | None"]


class BatchSource(Protocol):
    """What the loop needs from ``needle.data.batching.BatchPlan``."""

    def batch(self, step: int) -> dict[str, np.ndarray]: ...

    def eval_batches(self) -> Iterable[dict[str, np.ndarray]]: ...


@dataclass(frozen=True)
class Hook:
    """Run ``fn`` after steps that are multiples of ``every`` (0: only after the last step)."""

    fn: HookFn
    every: int = 0
    name: str = "hook"

    def due(self, step: int, final_step: int) -> bool:
        return step == final_step or (self.every > 0 and step % self.every == 0)


@dataclass
class TrainResult:
    """What a run produced; ``model_dir`` is filled in by ``run_training`` after export."""

    model_dir: str | None
    final_step: int
    history: list[dict[str, Any]] = field(default_factory=list)
    train_loss: float | None = None
    val_loss: float | None = None
    wall_s: float = 0.0
    tokens_per_s: float = 0.0
    # The final train state (device arrays); run_training drops it after export so the result
    # stays plain data.
    state: TrainState | None = field(default=None, repr=False, compare=False)


def metrics_hook(callback: Callable[[dict[str, Any], int], None], every: int = 1) -> Hook:
    """Pass each fetched metrics record (loss, tokens/s, step time, ...) to ``callback(m, step)``."""
    return Hook(lambda step, state, metrics: callback(dict(metrics), step), every, "metrics")


def checkpoint_hook(ckpt: Checkpointer, meta: dict[str, Any], every: int) -> Hook:
    """Save a checkpoint every ``every`` steps and after the last step."""

    def save(step: int, state: TrainState, metrics: dict[str, Any]) -> None:
        ckpt.save(state, meta, step=step)

    return Hook(save, every, "checkpoint")


def evaluate_loss(state: TrainState, plan: BatchSource, mesh: Mesh | None = None) -> dict[str, float]:
    """Token-weighted loss over every row of ``plan`` (one device fetch at the end)."""
    loss_sum, tokens = 0.0, 0.0
    for batch in plan.eval_batches():
        out = _eval_step(state, shard_batch(batch, mesh) if mesh is not None else batch)
        loss_sum, tokens = loss_sum + out["loss_sum"], tokens + out["tokens"]
    loss_sum, tokens = (float(x) for x in jax.device_get((loss_sum, tokens)))
    return {"val_loss": loss_sum / tokens if tokens else float("nan"), "val_tokens": tokens}


def validation_hook(plan: BatchSource, every: int, mesh: Mesh | None = None) -> Hook:
    """Add ``val_loss``/``val_tokens`` to the metrics every ``every`` steps and at the end."""
    return Hook(lambda step, state, metrics: evaluate_loss(state, plan, mesh), every, "validation")


class _Progress:
    """A rich bar (loss, tokens/s, ETA) on a terminal; plain log lines otherwise."""

    def __init__(self, enabled: bool, start: int, total: int) -> None:
        self._bar = None
        if enabled and sys.stdout.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._bar = Progress(
                TextColumn("train"), BarColumn(), MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]}  {task.fields[tps]} tok/s"), TimeRemainingColumn(),
            )  # fmt: skip
            self._task = self._bar.add_task("train", total=total, completed=start, loss="-", tps="-")
            self._bar.start()

    def advance(self) -> None:
        if self._bar is not None:
            self._bar.advance(self._task)

    def report(self, step: int, total: int, record: dict[str, Any]) -> None:
        if self._bar is not None:
            self._bar.update(self._task, loss=f"{record['loss']:.4f}", tps=f"{record['tokens_per_s']:,.0f}")
            return
        extra = f" val_loss {record['val_loss']:.4f}" if "val_loss" in record else ""
        log.info(
            "step %d/%d loss %.4f grad_norm %.3f lr %.2e %.0f tok/s%s",
            step, total, record["loss"], record["grad_norm"], record["lr"], record["tokens_per_s"], extra,
        )  # fmt: skip

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


def _fetch(pending: list[tuple[int, dict[str, jax.Array]]]) -> list[tuple[int, dict[str, float]]]:
    """One device transfer for all pending metrics; raise on the first non-finite loss."""
    fetched = jax.device_get(pending)
    out = []
    for step, metrics in fetched:
        values = {k: float(v) for k, v in metrics.items()}
        if not math.isfinite(values["loss"]):
            raise NonFiniteLossError(
                f"loss became {values['loss']} at step {step}; stopped before saving that state, "
                "the last good checkpoint is kept (lower optim.lr or check the data)"
            )
        out.append((step, values))
    return out


def train(
    state: TrainState,
    plan: BatchSource,
    train_cfg: TrainConfig,
    *,
    mesh: Mesh | None = None,
    hooks: Sequence[Hook] = (),
    val_plan: BatchSource | None = None,
    start_step: int = 0,
    progress: bool = True,
) -> TrainResult:
    """Run steps ``start_step+1 .. train_cfg.steps``; batch ``i`` is ``plan.batch(i)``."""
    total = train_cfg.steps
    if mesh is not None:
        state = replicate(state, mesh)
    all_hooks = list(hooks)
    if val_plan is not None:
        # First, so the hooks after it (metrics, tracker) see val_loss.
        all_hooks.insert(0, validation_hook(val_plan, train_cfg.eval_every, mesh))
    history: list[dict[str, Any]] = []
    pending: list[tuple[int, dict[str, jax.Array]]] = []
    window_tokens = 0  # padded tokens (B*T) processed since the last fetch: compute throughput
    t_start = t_window = time.perf_counter()
    timed_tokens, timed_s = 0, 0.0  # throughput excluding the first window (compilation)
    bar = _Progress(progress, start_step, total)
    try:
        for step in range(start_step + 1, total + 1):
            batch = plan.batch(step - 1)
            window_tokens += int(np.prod(np.shape(batch["inputs"])))
            state, metrics = _train_step(state, shard_batch(batch, mesh) if mesh is not None else batch)
            pending.append((step, metrics))
            bar.advance()
            due = [h for h in all_hooks if h.due(step, total)]
            if not due and step % train_cfg.log_every and step != total:
                continue
            window = _fetch(pending)
            now = time.perf_counter()
            dt = now - t_window
            record = _summarise(step, window, window_tokens, dt)
            if history:
                timed_tokens, timed_s = timed_tokens + window_tokens, timed_s + dt
            pending, window_tokens, t_window = [], 0, now
            for hook in due:
                extra = hook.fn(step, state, record)
                if extra:
                    record.update(extra)
            history.append(record)
            bar.report(step, total, record)
    finally:
        bar.close()
    wall = time.perf_counter() - t_start
    if not timed_s and history:  # a single window: include it, compilation and all
        timed_tokens, timed_s = sum(r["batch_tokens"] for r in history), wall
    return TrainResult(
        model_dir=None,
        final_step=max(total, start_step),
        history=history,
        train_loss=history[-1]["loss"] if history else None,
        val_loss=next((r["val_loss"] for r in reversed(history) if "val_loss" in r), None),
        wall_s=wall,
        tokens_per_s=timed_tokens / timed_s if timed_s else 0.0,
        state=state,
    )


def _summarise(step: int, window: list[tuple[int, dict[str, float]]], tokens: int, dt: float) -> dict[str, Any]:
    """One record per fetch: mean loss over the window, the last step's grad norm and lr."""
    last = window[-1][1]
    return {
        "step": step,
        "loss": float(np.mean([m["loss"] for _, m in window])),
        "grad_norm": last["grad_norm"],
        "lr": last["lr"],
        "tokens": float(sum(m["tokens"] for _, m in window)),
        "batch_tokens": tokens,
        "tokens_per_s": tokens / dt if dt > 0 else 0.0,
        "step_time_s": dt / len(window),
    }
