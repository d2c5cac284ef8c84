"""Shared tiny-model fixtures for tests/model (float32 CPU, the tiny preset)."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from needle.config import ModelConfig, model_preset
from needle.model.lora import init_params
from needle.model.transformer import Transformer


@pytest.fixture(scope="session")
def cfg() -> ModelConfig:
    return model_preset("tiny")


@pytest.fixture(scope="session")
def base_params(cfg: ModelConfig) -> dict:
    return init_params(cfg, None, jax.random.key(0))


@pytest.fixture(scope="session")
def make_tokens(cfg: ModelConfig) -> Callable[..., jax.Array]:
    """``make_tokens(shape, seed)``: ids in [9, vocab), clear of the special tokens like real text."""

    def make(shape: tuple[int, int], seed: int = 0) -> jax.Array:
        rng = np.random.default_rng(seed)
        return jnp.asarray(rng.integers(9, cfg.vocab_size, size=shape), dtype=jnp.int32)

    return make


def forward(model: Transformer, params: dict, tokens: jax.Array) -> jax.Array:
    """Jitted uncached forward: one compile instead of one dispatch per op (much faster on CPU)."""
    return jax.jit(model.apply)({"params": params}, tokens)


@pytest.fixture(scope="session")
def logits_of() -> Callable[[Transformer, dict, jax.Array], jax.Array]:
    return forward
