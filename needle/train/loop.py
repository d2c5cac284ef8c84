"""The training loop: jit once, never block per step, run hooks every N steps.

``train`` dispatches ``train_step`` asynchronously and keeps its metrics as device arrays;
every ``log_every`` steps (and whenever a hook is due, and at the end) it fetches them in one
transfer, stops with ``NonFiniteLossError`` at the first step whose loss or updated state is
NaN/inf (the step's ``finite`` flag, computed on device; checked before any hook, so no
checkpoint of a bad state is written), adds the validation loss when it is due, then runs the
hooks in order. Hooks are Levanter-style callables ``fn(info: StepInfo) -> None`` outside jit:
``info`` holds the step, the state and a read-only view of that step's metrics record.

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
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Iterable, Protocol, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from needle.config import TrainConfig
from needle.errors import NonFiniteLossError
from needle.train.checkpoint import Checkpointer
from needle.train.sharding import place_state, shard_batch
from needle.train.programs import StepPrograms
from needle.train.step import TrainState, eval_step, train_step

log = logging.getLogger(__name__)

# Compiled once per batch shape and state layout (packed plans have one shape; JAX's persistent
# cache, enabled by run_training, serves a warm process); the state is donated so the update
# happens in place.
def _programs() -> tuple[StepPrograms, StepPrograms]:
    return StepPrograms(train_step, donate=True), StepPrograms(eval_step, donate=False)


@dataclass(frozen=True)
class StepInfo:
    """What a hook is given after a step: the step, the state after it, its metrics (read-only)."""

    step: int
    state: TrainState
    metrics: Mapping[str, Any]


HookFn = Callable[[StepInfo], None]


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
        return _due(step, final_step, self.every)


def _due(step: int, final_step: int, every: int) -> bool:
    """After the last step, and after multiples of ``every`` (0: only the last)."""
    return step == final_step or (every > 0 and step % every == 0)


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
    # What run_training logged as the run's params (configs, data, sizes), for records.
    params: dict[str, Any] = field(default_factory=dict)
    # Step programs this run compiled, or reused from an earlier call in this process.
    programs: dict[str, int] = field(default_factory=dict)


def metrics_hook(callback: Callable[[dict[str, Any], int], None], every: int = 1) -> Hook:
    """Pass each fetched metrics record (loss, tokens/s, step time, ...) to ``callback(m, step)``."""
    return Hook(lambda info: callback(dict(info.metrics), info.step), every, "metrics")


def checkpoint_hook(ckpt: Checkpointer, meta: dict[str, Any], every: int) -> Hook:
    """Save a checkpoint every ``every`` steps and after the last step."""

    def save(info: StepInfo) -> None:
        ckpt.save(info.state, meta, step=info.step)

    return Hook(save, every, "checkpoint")


def evaluate_loss(
    state: TrainState, plan: BatchSource, mesh: Mesh | None = None, step_fn: StepPrograms | None = None
) -> dict[str, float]:
    """Token-weighted loss over every row of ``plan`` (one device fetch at the end)."""
    step_fn = step_fn or StepPrograms(eval_step, donate=False)
    loss_sum, tokens = 0.0, 0.0
    for batch in plan.eval_batches():
        out = step_fn(state, shard_batch(batch, mesh) if mesh is not None else batch)
        loss_sum, tokens = loss_sum + out["loss_sum"], tokens + out["tokens"]
    loss_sum, tokens = (float(x) for x in jax.device_get((loss_sum, tokens)))
    return {"val_loss": loss_sum / tokens if tokens else float("nan"), "val_tokens": tokens}


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
    """One device transfer for all pending metrics; raise on the first step with a non-finite state.

    Every step since the last fetch is checked (its ``finite`` flag covers the loss, the gradient
    norm and the updated params and optimizer state), so a hook never sees a state after a bad step.
    """
    fetched = jax.device_get(pending)
    out = []
    for step, metrics in fetched:
        values = {k: float(v) for k, v in metrics.items()}
        if not (values.pop("finite", 1.0) and math.isfinite(values["loss"])):
            raise NonFiniteLossError(
                f"training diverged at step {step}: loss {values['loss']}, grad_norm {values['grad_norm']}, "
                "and the updated state holds NaN or infinite values; stopped before saving that state, so "
                "the last good checkpoint is kept (lower optim.lr, in a fresh out_dir since a changed config "
                "does not resume, or check the data)"
            )
        out.append((step, values))
    return out


class _Window:
    """The steps dispatched since the last fetch, and throughput bookkeeping across windows."""

    def __init__(self) -> None:
        self.pending: list[tuple[int, dict[str, jax.Array]]] = []
        self.tokens = 0  # padded tokens (B*T) since the last fetch: compute throughput
        self.t_start = self.t_window = time.perf_counter()
        self.timed_tokens, self.timed_s = 0, 0.0  # throughput excluding the first window (compilation)

    def add(self, step: int, metrics: dict[str, jax.Array], batch_tokens: int) -> None:
        self.pending.append((step, metrics))
        self.tokens += batch_tokens

    def close(self, step: int, first: bool) -> dict[str, Any]:
        """Fetch the window's metrics (raising on a non-finite loss) into one record."""
        window = _fetch(self.pending)
        now = time.perf_counter()
        dt = now - self.t_window
        record = _summarise(step, window, self.tokens, dt)
        if not first:
            self.timed_tokens, self.timed_s = self.timed_tokens + self.tokens, self.timed_s + dt
        self.pending, self.tokens, self.t_window = [], 0, now
        return record

    def result(self, history: list[dict[str, Any]], final_step: int, state: TrainState) -> TrainResult:
        wall = time.perf_counter() - self.t_start
        timed_tokens, timed_s = self.timed_tokens, self.timed_s
        if not timed_s and history:  # a single window: include it, compilation and all
            timed_tokens, timed_s = sum(r["batch_tokens"] for r in history), wall
        return TrainResult(
            model_dir=None,
            final_step=final_step,
            history=history,
            train_loss=history[-1]["loss"] if history else None,
            val_loss=next((r["val_loss"] for r in reversed(history) if "val_loss" in r), None),
            wall_s=wall,
            tokens_per_s=timed_tokens / timed_s if timed_s else 0.0,
            state=state,
        )


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
    """Run steps ``start_step+1 .. train_cfg.steps``; batch ``i`` is ``plan.batch(i)``.

    The validation loss (``val_plan``, every ``eval_every`` steps and at the end) is added to a
    step's record before the hooks run, so they all see it.
    """
    total = train_cfg.steps
    if mesh is not None:  # LoRA adapters stay replicated; full fine-tuning shards what it trains
        state = place_state(state, mesh, shard_trainable=train_cfg.mode != "lora")
    history: list[dict[str, Any]] = []
    window = _Window()
    bar = _Progress(progress, start_step, total)
    train_fn, eval_fn = _programs()
    try:
        for step in range(start_step + 1, total + 1):
            batch = plan.batch(step - 1)
            state, metrics = train_fn(state, shard_batch(batch, mesh) if mesh is not None else batch)
            window.add(step, metrics, int(np.prod(np.shape(batch["inputs"]))))
            bar.advance()
            due = [h for h in hooks if h.due(step, total)]
            validate = val_plan is not None and _due(step, total, train_cfg.eval_every)
            if not (due or validate) and step % train_cfg.log_every and step != total:
                continue
            record = window.close(step, first=not history)
            if validate:
                record.update(evaluate_loss(state, val_plan, mesh, eval_fn))
            info = StepInfo(step, state, MappingProxyType(record))
            for hook in due:
                hook.fn(info)
            history.append(record)
            bar.report(step, total, record)
    finally:
        bar.close()
    log.info("train step programs: %(compiled)d compiled, %(reused)d reused", train_fn.stats)
    result = window.result(history, max(total, start_step), state)
    result.programs = {f"train_{k}": v for k, v in train_fn.stats.items()} | {f"eval_{k}": v for k, v in eval_fn.stats.items()}
    return result


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
