"""Shared eval fixtures: validated sample rows, a tokenizer trained on them, a saved tiny model."""

from __future__ import annotations

from pathlib import Path

import pytest

from needle.data.schema import Row

VOCAB = 1024  # at 1024 the sample prompts are ~120-160 tokens: they fit the tiny preset's 320


@pytest.fixture(scope="session")
def eval_rows(sample_data: dict[str, Path]) -> list[Row]:
    from needle.data.load import read_rows

    rows, _ = read_rows(str(sample_data["new"]))
    return rows


@pytest.fixture(scope="session")
def eval_tokenizer(eval_rows: list[Row]):
    from needle.data.render import render_text
    from needle.tokenizers.native import train_tokenizer

    return train_tokenizer([render_text(r) for r in eval_rows], VOCAB)


@pytest.fixture(scope="session")
def tiny_model_dir(eval_tokenizer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A randomly initialised tiny model exported with needle.model.io.save_model."""
    from needle.config import model_preset
    from needle.model.io import save_model
    from needle.model.lora import init_params

    cfg = model_preset("tiny", vocab_size=VOCAB)
    params = init_params(cfg, None, 0)
    return save_model(tmp_path_factory.mktemp("model") / "model", params, cfg, eval_tokenizer, {"test": True})
