"""Shared tiny-model fixtures for tests/model (float32 CPU, the tiny preset)."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from needle.config import LoraConfig, ModelConfig, model_preset
from needle.model.lora import attach_base, init_params
from needle.model.decoder.transformer import Transformer


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


_FORWARDS: dict[Transformer, Callable[..., jax.Array]] = {}


def forward(model: Transformer, params: dict, tokens: jax.Array) -> jax.Array:
    """Jitted uncached forward, compiled once per model (per-op dispatch is far slower on CPU)."""
    if model not in _FORWARDS:
        _FORWARDS[model] = jax.jit(model.apply)
    return _FORWARDS[model]({"params": params}, tokens)


@pytest.fixture(scope="session")
def logits_of() -> Callable[[Transformer, dict, jax.Array], jax.Array]:
    return forward


@pytest.fixture(scope="session")
def lora_cfg() -> LoraConfig:
    return LoraConfig(rank=4, alpha=8.0)


@pytest.fixture(scope="session")
def lora_params(cfg: ModelConfig, lora_cfg: LoraConfig, base_params: dict) -> dict:
    """A fresh adapter tree (every projection) carrying the base weights."""
    return attach_base(init_params(cfg, lora_cfg, jax.random.key(1)), base_params)
