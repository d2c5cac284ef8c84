"""Masked token cross-entropy without the full ``[B, T, V]`` logits.

``chunked_loss_sum(logits_fn, hidden, targets, mask, chunk)`` flattens the final hidden states
``[B, T, D]`` to ``[N, D]`` tokens and scans over chunks of ``chunk`` tokens: each chunk forms its
float32 logits ``[chunk, V]`` through ``logits_fn`` (output layer and soft cap of the model),
takes optax's integer-label softmax cross-entropy and adds up ``loss * mask``. The chunk body
runs under ``jax.checkpoint``, so the backward pass recomputes one chunk's logits at a time
instead of keeping any: peak memory for the output layer is ``chunk x V`` floats, not
``B x T x V``. The sum and its gradient equal the dense computation's to float32 rounding.

Any model family plugs in through a pair of calls (the contract of needle/model/decoder/transformer.py):
``apply(v, ids, positions, segment_ids=..., return_hidden=True) -> hidden [B, T, D]`` and
``apply(v, hidden_chunk, method="logits") -> float32 [..., V]``; :func:`model_loss_sum` does both.

    total, tokens = model_loss_sum(model, {"params": p}, batch, chunk=256)
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax


def dense_loss_sum(logits: jax.Array, targets: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Sum of masked token cross-entropies of full logits ``[B, T, V]`` and the loss-token count."""
    losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
    mask = mask.astype(jnp.float32)
    return jnp.sum(losses * mask), jnp.sum(mask)


def chunked_loss_sum(
    logits_fn: Callable[[jax.Array], jax.Array], hidden: jax.Array, targets: jax.Array, mask: jax.Array, chunk: int,
) -> tuple[jax.Array, jax.Array]:  # fmt: skip
    """Sum of masked token cross-entropies and the loss-token count, ``chunk`` tokens at a time."""
    if chunk <= 0:
        raise ValueError(f"chunk must be positive, got {chunk}")
    d = hidden.shape[-1]
    h = hidden.reshape(-1, d)
    y = targets.reshape(-1).astype(jnp.int32)
    m = mask.reshape(-1).astype(jnp.float32)
    n = h.shape[0]
    chunk = min(chunk, n)
    pad = (-n) % chunk
    if pad:  # padding tokens carry mask 0: they add nothing to the sum or the gradient
        h = jnp.concatenate([h, jnp.zeros((pad, d), h.dtype)])
        y = jnp.concatenate([y, jnp.zeros((pad,), y.dtype)])
        m = jnp.concatenate([m, jnp.zeros((pad,), m.dtype)])
    steps = h.shape[0] // chunk

    def chunk_loss(hc: jax.Array, yc: jax.Array, mc: jax.Array) -> jax.Array:
        logits = logits_fn(hc).astype(jnp.float32)
        return jnp.sum(optax.softmax_cross_entropy_with_integer_labels(logits, yc) * mc)

    @jax.checkpoint
    def one(hc: jax.Array, yc: jax.Array, mc: jax.Array) -> jax.Array:
        # A chunk without loss tokens adds exactly 0 and passes back a zero gradient, so it skips
        # the output layer, forward and backward: most chunks of a tool-calling row are prompt.
        skip = lambda hc, yc, mc: jnp.zeros((), jnp.float32)  # noqa: E731
        return jax.lax.cond(jnp.any(mc != 0), chunk_loss, skip, hc, yc, mc)

    if steps == 1:
        total = one(h, y, m)
    else:
        def body(acc: jax.Array, xs: tuple[jax.Array, jax.Array, jax.Array]) -> tuple[jax.Array, None]:
            return acc + one(*xs), None

        xs = (h.reshape(steps, chunk, d), y.reshape(steps, chunk), m.reshape(steps, chunk))
        total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32), xs)
    return total, jnp.sum(m)


def model_loss_sum(
    model: Any, variables: dict[str, Any], batch: dict[str, jax.Array], chunk: int
) -> tuple[jax.Array, jax.Array]:
    """Masked loss sum and token count of ``batch`` (inputs, targets, mask; packed batches also
    positions and segment_ids) under ``model``: chunked when ``chunk > 0``, else from full logits."""
    if "segment_ids" in batch:
        args: tuple[Any, ...] = (batch["inputs"], batch["positions"])
        kwargs: dict[str, Any] = {"segment_ids": batch["segment_ids"]}
    else:
        args, kwargs = (batch["inputs"],), {}
    if chunk <= 0:
        return dense_loss_sum(model.apply(variables, *args, **kwargs), batch["targets"], batch["mask"])
    hidden = model.apply(variables, *args, return_hidden=True, **kwargs)
    logits_fn = lambda h: model.apply(variables, h, method="logits")  # noqa: E731
    return chunked_loss_sum(logits_fn, hidden, batch["targets"], batch["mask"], chunk)
