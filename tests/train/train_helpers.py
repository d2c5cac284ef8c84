"""Helpers for tests/train: the tiny model (vocab 64, 32 tokens), synthetic rows, fresh states."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import datasets
import jax
import jax.numpy as jnp
import numpy as np

from needle.config import LoraConfig, ModelConfig, OptimConfig, TrainConfig, model_preset
from needle.data.batching import BatchPlan, PackedPlan
from needle.data.prepare import PreparedData
from needle.model import lora as lora_lib
from needle.model.decoder.transformer import Transformer
from needle.tokenizers.native import Tokenizer, train_tokenizer
from needle.train.run import make_apply_fn
from needle.train.step import TrainState, create_state

VOCAB = 64
MAX_LEN = 32
LORA = LoraConfig(rank=4, alpha=8.0)


def tiny_model_cfg() -> ModelConfig:
    return model_preset("tiny", vocab_size=VOCAB, max_len=MAX_LEN)


def synthetic_split(n_rows: int, seed: int = 0) -> datasets.Dataset:
    """Rows of random ids (pad id 0 never used) whose second half carries the loss.

    Lengths 18..32 all land in the 32-token bucket: one batch shape, so one compilation.
    """
    rng = np.random.default_rng(seed)
    ids, masks = [], []
    for _ in range(n_rows):
        length = int(rng.integers(18, MAX_LEN + 1))
        ids.append(rng.integers(1, VOCAB, size=length).astype(np.int32).tolist())
        masks.append([0] * (length // 2) + [1] * (length - length // 2))
    return datasets.Dataset.from_dict({"ids": ids, "loss_mask": masks, "length": [len(x) for x in ids]})


def make_plan(n_rows: int = 24, batch_size: int = 4, seed: int = 0) -> BatchPlan:
    return BatchPlan(synthetic_split(n_rows, seed), batch_size=batch_size, max_len=MAX_LEN, seed=seed)


def make_packed_plan(n_rows: int = 24, batch_size: int = 2, seed: int = 0, seq_len: int = 64) -> PackedPlan:
    """Rows of 18..32 tokens packed two or three to a 64-slot sequence; a few batches per epoch."""
    return PackedPlan(synthetic_split(n_rows, seed), batch_size=batch_size, seq_len=seq_len, seed=seed)


@functools.lru_cache(maxsize=None)
def _init_params(with_lora: bool, seed: int):
    # init_params compiles afresh on every call (seconds on a busy CPU): build each tree once.
    return lora_lib.init_params(tiny_model_cfg(), LORA if with_lora else None, seed)


def make_state(
    mode: str = "scratch",
    *,
    steps: int = 10,
    grad_accum: int = 1,
    optim: OptimConfig | None = None,
    seed: int = 0,
) -> TrainState:
    """A fresh tiny state; ``lora`` puts rank-4 adapters on a randomly initialised base."""
    cfg = tiny_model_cfg()
    lora = LORA if mode == "lora" else None
    # A copy: the loop donates the state, which would delete the cached arrays.
    params = jax.tree.map(jnp.copy, _init_params(mode == "lora", seed))
    trainable, frozen = lora_lib.split_trainable(params, mode)
    return create_state(
        make_apply_fn(Transformer(cfg, lora)), trainable, frozen,
        optim or OptimConfig(lr=1e-2, warmup_steps=0), steps, grad_accum=grad_accum, seed=seed,
    )  # fmt: skip


def train_cfg(**overrides) -> TrainConfig:
    base = dict(mode="scratch", steps=6, batch_size=4, log_every=2, checkpoint_every=3, compilation_cache_dir=None)
    return TrainConfig.model_validate({**base, **overrides})


def tiny_tokenizer() -> Tokenizer:
    """A real byte-level BPE (the smallest allowed vocabulary) for run_training's bookkeeping."""
    texts = ["get_weather city Paris", "send_email to bob subject hi", "search_web query jax"] * 4
    return train_tokenizer(texts, vocab_size=300)


def tiny_prepared(n_train: int = 16, n_val: int = 8, fingerprint: str = "synthetic-0") -> PreparedData:
    """PreparedData over synthetic single-bucket rows (ids < VOCAB are valid for any tokenizer)."""
    splits = {"train": synthetic_split(n_train, seed=1), "val": synthetic_split(n_val, seed=2)}
    return PreparedData(splits=splits, fingerprint=fingerprint, stats={})


def finetune_configs(mode: str, steps: int = 6, **train_overrides) -> tuple[ModelConfig, TrainConfig, OptimConfig]:
    """Configs for run_training: the tiny preset (vocab 1024 > the tokenizer's 300), 32 tokens."""
    model = model_preset("tiny", max_len=MAX_LEN)
    train = train_cfg(mode=mode, steps=steps, checkpoint_every=2, log_every=1, eval_every=0, **train_overrides)
    return model, train, OptimConfig(lr=1e-2, warmup_steps=0)


def scratch_reference(tmp_path: Path, steps: int) -> tuple[Any, ...]:
    """For the kill tests: the tiny data and tokenizer, saved under ``tmp_path`` for child
    processes, the scratch configs, and the uninterrupted run's result in ``tmp_path/reference``.

    Returns ``(prepared, tok, data_dir, tok_dir, (model_cfg, train, optim), reference)``.
    """
    from needle.train.run import run_training

    prepared, tok = tiny_prepared(), tiny_tokenizer()
    data_dir, tok_dir = prepared.save(tmp_path / "data"), tmp_path / "tok"
    tok.save(tok_dir)
    configs = finetune_configs("scratch", steps=steps)
    reference = run_training(prepared, tok, *configs, out_dir=tmp_path / "reference")
    return prepared, tok, data_dir, tok_dir, configs, reference
