"""One optimizer step, pure and jit-able: train state, optimizer, loss, grads, metrics.

``train_step(state, batch)`` is a module-level pure function (the loop jits it once with the
state donated). The loss is the masked token cross-entropy in float32, token-weighted so that
gradient accumulation over micro-batches gives the same loss and gradient as one big batch.
Only ``state.trainable`` receives gradients; ``state.frozen`` (a LoRA base) is closed over.

    from needle.train.step import create_state, train_step
    state = create_state(apply_fn, trainable, frozen, optim_cfg, total_steps=100)
    state, metrics = jax.jit(train_step, donate_argnums=0)(state, batch)

``apply_fn(trainable, frozen, inputs) -> float32 logits [B, T, V]``;
``metrics`` = loss, grad_norm, lr, tokens and ``finite`` (the new state holds no NaN/inf);
``batch = {"inputs": int32[B, T], "targets": int32[B, T], "mask": float32[B, T]}``. A packed
batch (``needle.data.batching.PackedPlan``) adds ``positions`` and ``segment_ids`` (int32[B, T]),
passed on as ``apply_fn(trainable, frozen, inputs, positions=..., segment_ids=...)``; the loss
stays the token-weighted mean over the mask, so it equals the loss of the same rows unpacked.

When ``apply_fn`` carries its Flax module as ``apply_fn.model`` (``needle.train.run.ModelApply``)
and the module's ``settings.loss_chunk`` is positive, the loss never forms the ``[B, T, V]``
logits: it takes the final hidden states (``return_hidden=True``) and computes the output layer
and cross-entropy ``loss_chunk`` tokens at a time (needle/train/loss.py); equal to the dense
loss and gradient to float32 rounding. ``loss_chunk=0`` (or a bare function) is the dense path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import struct

from needle.config import OptimConfig
from needle.hardware import BackendSettings, settings_for
from needle.model import lora as lora_lib
from needle.train.loss import dense_loss_sum, model_loss_sum

PyTree = Any
ApplyFn = Callable[[PyTree, PyTree, jax.Array], jax.Array]
Batch = dict[str, jax.Array]

# Parameter names (any path component containing one of these) that get no weight decay:
# decaying norm gains or embedding rows pulls them towards zero for no regularisation benefit.
_NO_DECAY_NAMES = ("norm", "embed", "scale", "bias")


class TrainState(struct.PyTreeNode):
    """Everything a step reads and writes; the static fields are part of the jit cache key."""

    step: jax.Array  # int32 scalar: optimizer steps taken (also the BatchPlan position)
    trainable: PyTree
    frozen: PyTree
    opt_state: optax.OptState
    rng: jax.Array  # raw uint32[2] key (orbax-serialisable); checkpointed so a resume keeps any sampling exact
    # Static fields compare by value (a hashable apply_fn, an Optimizer described by its config),
    # so equal configs reuse the compiled step, e.g. after a resume in the same process.
    apply_fn: ApplyFn = struct.field(pytree_node=False)
    tx: "Optimizer" = struct.field(pytree_node=False)
    # Static so the micro-batch reshape has a known shape under jit.
    grad_accum: int = struct.field(pytree_node=False, default=1)


def make_schedule(optim: OptimConfig, total_steps: int) -> optax.Schedule:
    """Linear warmup to ``optim.lr`` then cosine decay to ``min_lr_ratio * lr`` at ``total_steps``."""
    if total_steps <= 0:
        raise ValueError(f"total_steps must be positive, got {total_steps}")
    warmup = min(optim.warmup_steps, total_steps - 1)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0 if warmup else optim.lr,
        peak_value=optim.lr,
        warmup_steps=warmup,
        # optax counts decay_steps from 0 including the warmup; keep the cosine part non-empty.
        decay_steps=max(total_steps, warmup + 1),
        end_value=optim.lr * optim.min_lr_ratio,
    )


def decay_mask(params: PyTree) -> PyTree:
    """True for weight matrices that get weight decay; False for norms, embeddings, vectors."""

    def wants_decay(path: tuple[Any, ...], leaf: jax.Array) -> bool:
        names = "/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path).lower()
        return leaf.ndim >= 2 and not any(n in names for n in _NO_DECAY_NAMES)

    return jax.tree_util.tree_map_with_path(wants_decay, params)


def make_optimizer(optim: OptimConfig, total_steps: int) -> optax.GradientTransformation:
    """Clip by global norm, then AdamW on the warmup-cosine schedule (decay masked off norms)."""
    return optax.chain(
        optax.clip_by_global_norm(optim.clip_norm),
        optax.adamw(
            learning_rate=make_schedule(optim, total_steps),
            b1=optim.b1,
            b2=optim.b2,
            weight_decay=optim.weight_decay,
            mask=decay_mask,
        ),
    )


@dataclass(frozen=True)
class Optimizer:
    """``make_optimizer(optim, total_steps)`` as a value: an optax transformation with equality."""

    optim: OptimConfig
    total_steps: int

    def transformation(self) -> optax.GradientTransformation:
        return make_optimizer(self.optim, self.total_steps)

    def schedule(self, step: jax.Array) -> jax.Array:
        return make_schedule(self.optim, self.total_steps)(step)

    def init(self, params: PyTree) -> optax.OptState:
        return self.transformation().init(params)

    def update(self, grads: PyTree, opt_state: optax.OptState, params: PyTree) -> tuple[PyTree, optax.OptState]:
        return self.transformation().update(grads, opt_state, params)


def create_state(
    apply_fn: ApplyFn,
    trainable: PyTree,
    frozen: PyTree,
    optim: OptimConfig,
    total_steps: int,
    *,
    grad_accum: int = 1,
    seed: int = 0,
) -> TrainState:
    """Build the initial state: step 0, fresh optimizer moments, a seeded RNG."""
    if grad_accum <= 0:
        raise ValueError(f"grad_accum must be positive, got {grad_accum}")
    tx = Optimizer(optim, total_steps)
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        trainable=trainable,
        frozen=frozen,
        opt_state=tx.init(trainable),
        rng=jax.random.PRNGKey(seed),
        apply_fn=apply_fn,
        tx=tx,
        grad_accum=grad_accum,
    )


def _loss_sum(apply_fn: ApplyFn, trainable: PyTree, frozen: PyTree, batch: Batch) -> tuple[jax.Array, jax.Array]:
    """Sum of masked token cross-entropies (float32) and the number of loss tokens."""
    chunk = loss_chunk_of(apply_fn)
    if chunk:
        variables = {"params": lora_lib.combine(trainable, frozen)}
        return model_loss_sum(apply_fn.model, variables, batch, chunk)  # type: ignore[attr-defined]
    if "segment_ids" in batch:  # packed rows: RoPE positions restart per row, attention stays within it
        logits = apply_fn(trainable, frozen, batch["inputs"], positions=batch["positions"], segment_ids=batch["segment_ids"])
    else:
        logits = apply_fn(trainable, frozen, batch["inputs"])
    return dense_loss_sum(logits, batch["targets"], batch["mask"])


def _settings_of(apply_fn: ApplyFn) -> BackendSettings | None:
    """The backend settings of ``apply_fn``'s model (a model without its own: the CPU's), None for
    a bare function."""
    model = getattr(apply_fn, "model", None)
    if model is None:
        return None
    return getattr(model, "settings", None) or settings_for("cpu")


def loss_chunk_of(apply_fn: ApplyFn) -> int:
    """Tokens per loss chunk of ``apply_fn``'s model (0: dense logits, also for a bare function)."""
    settings = _settings_of(apply_fn)
    return 0 if settings is None else settings.loss_chunk


def _split_micro(x: jax.Array, accum: int) -> jax.Array:
    """[B, ...] -> [accum, B/accum, ...], micro-batch a = rows a, a+accum, ...

    Interleaving (rather than contiguous blocks) keeps every micro-batch spread evenly over the
    data-parallel shards of the leading axis, so no rows move between devices.
    """
    b = x.shape[0]
    if b % accum:
        raise ValueError(f"batch of {b} rows is not divisible by grad_accum={accum}")
    return jnp.swapaxes(x.reshape(b // accum, accum, *x.shape[1:]), 0, 1)


def count_micro_batches(rows: int, seq: int, grad_accum: int, min_tokens: int, shards: int = 1) -> int:
    """Micro-batches of a ``rows x seq`` step: ``grad_accum``, doubled while each micro-batch would
    still hold at least ``min_tokens`` tokens (0: never) and a whole multiple of ``shards`` rows."""
    accum = grad_accum
    while min_tokens and rows % (2 * accum) == 0:
        half = rows // (2 * accum)
        if half * seq < min_tokens or half % shards:
            break
        accum *= 2
    return accum


def micro_batches_of(state: TrainState, batch: Batch) -> int:
    """How many micro-batches ``train_step`` runs ``batch`` in: ``state.grad_accum``, split further
    by the model's ``settings.micro_batch_tokens`` (a batch already in micro-batches stays so)."""
    if batch["inputs"].ndim != 2:
        return batch["inputs"].shape[0]
    settings = _settings_of(state.apply_fn)
    min_tokens = 0 if settings is None else settings.micro_batch_tokens
    rows, seq = batch["inputs"].shape
    # Micro-batch rows stay a multiple of the devices, so no micro-batch leaves a device idle.
    return count_micro_batches(rows, seq, state.grad_accum, min_tokens, jax.device_count())


def _sum_grads(state: TrainState, batch: Batch) -> tuple[jax.Array, jax.Array, PyTree]:
    """Loss sum, token count and gradient of the loss sum, accumulated over micro-batches."""
    grad_fn = jax.value_and_grad(
        lambda tr, fr, b: _loss_sum(state.apply_fn, tr, fr, b), argnums=0, has_aux=True
    )
    frozen = jax.lax.stop_gradient(state.frozen)
    accum = micro_batches_of(state, batch)
    if accum == 1 and batch["inputs"].ndim == 2:
        (loss_sum, tokens), grads = grad_fn(state.trainable, frozen, batch)
        return loss_sum, tokens, grads
    # A batch may already carry a leading micro-batch axis [A, B/A, T]; else split [B, T].
    micro = batch if batch["inputs"].ndim == 3 else {k: _split_micro(v, accum) for k, v in batch.items()}

    def accumulate(carry: tuple[jax.Array, jax.Array, PyTree], mb: Batch):
        loss_acc, tok_acc, grad_acc = carry
        (loss_sum, tokens), grads = grad_fn(state.trainable, frozen, mb)
        return (loss_acc + loss_sum, tok_acc + tokens, jax.tree.map(jnp.add, grad_acc, grads)), None

    zeros = jax.tree.map(jnp.zeros_like, state.trainable)
    init = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32), zeros)
    (loss_sum, tokens, grads), _ = jax.lax.scan(accumulate, init, micro)
    return loss_sum, tokens, grads


def loss_and_grads(state: TrainState, batch: Batch) -> tuple[jax.Array, jax.Array, PyTree]:
    """Mean token loss, loss-token count, and the gradient of the mean w.r.t. ``trainable``."""
    loss_sum, tokens, grads = _sum_grads(state, batch)
    # A batch of only padding has no loss tokens: a zero gradient instead of 0/0 NaNs.
    denom = jnp.maximum(tokens, 1.0)
    return loss_sum / denom, tokens, jax.tree.map(lambda g: g / denom, grads)


def tree_all_finite(tree: PyTree) -> jax.Array:
    """A bool scalar: no floating leaf of ``tree`` holds a NaN or an infinity (integer leaves pass)."""
    flags = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
    return jnp.all(jnp.stack(flags)) if flags else jnp.asarray(True)


def train_step(state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimizer step on a batch; returns the new state and device-side metrics.

    ``metrics["finite"]`` (bool) is False when the loss, the gradient norm or any leaf of the
    updated trainable params or optimizer state is NaN/inf: computed in this same program, so
    the loop can refuse to checkpoint such a state without a per-step host sync.
    """
    loss, tokens, grads = loss_and_grads(state, batch)
    updates, opt_state = state.tx.update(grads, state.opt_state, state.trainable)
    trainable = optax.apply_updates(state.trainable, updates)
    grad_norm = optax.tree.norm(grads)
    metrics = {
        "loss": loss,
        "grad_norm": grad_norm,
        "lr": jnp.asarray(state.tx.schedule(state.step), jnp.float32),
        "tokens": tokens,
        "finite": jnp.isfinite(loss) & jnp.isfinite(grad_norm) & tree_all_finite((trainable, opt_state)),
    }
    new_state = state.replace(step=state.step + 1, trainable=trainable, opt_state=opt_state)
    return new_state, metrics


def eval_step(state: TrainState, batch: Batch) -> dict[str, jax.Array]:
    """Masked loss sum and token count on one batch (sum over batches, then divide)."""
    loss_sum, tokens = _loss_sum(state.apply_fn, state.trainable, state.frozen, batch)
    return {"loss_sum": loss_sum, "tokens": tokens}
