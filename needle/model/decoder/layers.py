"""The dense and norm layers of needle's transformer blocks (needle/model/decoder/block.py).

``LoraDense`` is a bias-free (optionally biased) projection with an optional LoRA adapter, the
adapter path ``(x·A)·B`` kept apart from ``x·W``; ``RMSNorm`` normalises in float32 with a learned
scale, ``w`` or Gemma's ``1 + w``.

    y = LoraDense(features=64, rank=8, scale=2.0, name="q_proj")(x)
    h = RMSNorm(eps=1e-6, name="attn_norm")(x)
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from needle.model.decoder.recompute import grads_before_input


class LoraDense(nn.Module):
    """Bias-free ``y = x·W + scale·((x·A)·B)``; ``rank == 0`` means a plain dense layer.

    B starts at zero so a fresh adapter leaves the layer unchanged; W + A·B is never formed,
    which keeps the adapter path cheap and gradients flowing only where they should.
    """

    features: int
    rank: int = 0
    scale: float = 1.0
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    use_bias: bool = False
    # The adapter gradients before the input's (recompute.grads_before_input): a workaround for XLA's
    # CPU scheduler, which otherwise keeps every layer's inputs alive to the step's end; off the CPU
    # it would only serialise the backward pass (_Layer.proj sets it for the CPU backend only).
    order_grads: bool = True
    # > 0: the output as [..., heads, features / heads] (attention's q/k/v), each matmul writing
    # that layout itself; the parameters keep their [in, features] shapes.
    heads: int = 0

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        d_in = x.shape[-1]
        kernel = self.param("kernel", nn.initializers.lecun_normal(), (d_in, self.features), self.param_dtype)
        x = x.astype(self.dtype)
        out = (self.heads, self.features // self.heads) if self.heads else (self.features,)

        def project(h: jax.Array, w: jax.Array) -> jax.Array:
            w = w.astype(self.dtype).reshape(w.shape[0], *out)
            return jax.lax.dot_general(h, w, (((h.ndim - 1,), (0,)), ((), ())))

        y = project(x, kernel)
        if self.rank:
            a = self.param("lora_a", nn.initializers.normal(d_in**-0.5), (d_in, self.rank), self.param_dtype)
            b = self.param("lora_b", nn.initializers.zeros_init(), (self.rank, self.features), self.param_dtype)
            xa, a, b = grads_before_input(x, a, b) if self.order_grads else (x, a, b)
            down = checkpoint_name(jnp.dot(xa, a.astype(self.dtype)), "lora_down")
            y = y + self.scale * project(down, b)
        if self.use_bias:
            bias = self.param("bias", nn.initializers.zeros_init(), (self.features,), self.param_dtype)
            y = y + bias.astype(self.dtype).reshape(out)
        # Named for remat "projections_saveable" (needle/model/decoder/scan.py), which keeps this sum
        # and the rank-wide x·A: a dots policy would keep x·W and (x·A)·B apart, twice the memory.
        return checkpoint_name(y, "proj_out")


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale (``w``, or ``1 + w`` for Gemma), in float32."""

    eps: float
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    offset_one: bool = False

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        # Gemma stores w with the identity at 0, so a fresh offset norm starts at zeros.
        init = nn.initializers.zeros_init() if self.offset_one else nn.initializers.ones_init()
        scale = self.param("scale", init, (x.shape[-1],), self.param_dtype).astype(jnp.float32)
        if self.offset_one:
            scale = 1.0 + scale
        x = x.astype(jnp.float32)
        y = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + self.eps)
        return (y * scale).astype(self.dtype)
