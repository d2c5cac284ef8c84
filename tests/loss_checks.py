"""A shared check for the chunked loss (needle/train/loss.py) through a model family."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from needle.train.loss import model_loss_sum


def assert_chunked_equals_dense(model: Any, params: Any, batch: dict, chunks: tuple[int, ...], atol: float = 1e-5) -> Any:
    """``model_loss_sum``'s mean loss and its gradient w.r.t. every param, at each chunk size,
    equal the dense path's (``chunk=0``); returns the dense gradient."""

    def loss(p: Any, chunk: int) -> Any:
        total, n = model_loss_sum(model, {"params": p}, batch, chunk)
        return total / n

    grad = jax.jit(jax.value_and_grad(loss), static_argnums=1)
    ref, gref = grad(params, 0)
    for chunk in chunks:
        val, got = grad(params, chunk)
        np.testing.assert_allclose(float(val), float(ref), rtol=1e-5, atol=1e-5)
        for a, b in zip(jax.tree.leaves(gref), jax.tree.leaves(got)):
            np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=atol)
    return gref
