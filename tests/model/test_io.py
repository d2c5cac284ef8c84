"""Exported model directory: round trip, atomic replace, and refusals with clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from flax import traverse_util

from needle.errors import CheckpointMismatchError
from needle.model.io import load_model, save_model
from needle.model.decoder.transformer import Transformer
from needle.tokenizers.native import Tokenizer, train_tokenizer


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    texts = ['{"name":"get_weather","arguments":{"city":"Paris"}}', "what is the weather in Paris today?"] * 20
    return train_tokenizer(texts, 300)


class _CrashingTokenizer:
    vocab_size = 300

    def save(self, directory: Path) -> Path:
        raise RuntimeError("disk full")


def _assert_same_params(a: dict, b: dict) -> None:
    fa, fb = traverse_util.flatten_dict(a), traverse_util.flatten_dict(b)
    assert fa.keys() == fb.keys()
    for k in fa:
        np.testing.assert_array_equal(np.asarray(fa[k]), np.asarray(fb[k]), err_msg="/".join(k))


def test_round_trip_and_replace(tmp_path, cfg, base_params, tokenizer, make_tokens, logits_of):
    target = tmp_path / "model"
    meta = {"run_id": "abc", "metrics": {"exact_match": 0.5}}
    assert save_model(target, base_params, cfg, tokenizer, meta) == target
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
    loaded = load_model(target)
    _assert_same_params(loaded.params, base_params)
    assert loaded.model_cfg == cfg and loaded.meta == meta and loaded.tokenizer == tokenizer
    tokens = make_tokens((1, 6))
    np.testing.assert_array_equal(
        np.asarray(logits_of(Transformer(loaded.model_cfg), loaded.params, tokens)),
        np.asarray(logits_of(Transformer(cfg), base_params, tokens)),
    )

    # Saving over an existing model replaces it whole; a crashing save leaves it untouched.
    save_model(target, base_params, cfg, tokenizer, {"run_id": "def"})
    assert load_model(target).meta == {"run_id": "def"}
    with pytest.raises(RuntimeError, match="disk full"):
        save_model(target, base_params, cfg, _CrashingTokenizer(), {"run_id": "ghi"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
    assert json.loads((target / "meta.json").read_text()) == {"run_id": "def"}


def test_crash_leaves_nothing(tmp_path, cfg, base_params):
    with pytest.raises(RuntimeError, match="disk full"):
        save_model(tmp_path / "model", base_params, cfg, _CrashingTokenizer(), {})
    assert list(tmp_path.iterdir()) == []


def test_save_refuses_bad_params(tmp_path, cfg, base_params, tokenizer):
    flat = traverse_util.flatten_dict(base_params)
    flat[("block_0", "attn", "q_proj", "lora_a")] = np.zeros((cfg.d_model, 2), np.float32)
    with_adapter = traverse_util.unflatten_dict(flat)
    with pytest.raises(ValueError, match="merge_lora first"):
        save_model(tmp_path / "m", with_adapter, cfg, tokenizer, {})
    with pytest.raises(CheckpointMismatchError, match="gate_proj/kernel: shape"):
        save_model(tmp_path / "m", base_params, cfg.model_copy(update={"d_ff": 32}), tokenizer, {})
    with pytest.raises(ValueError, match="not JSON-serialisable"):
        save_model(tmp_path / "m", base_params, cfg, tokenizer, {"when": object()})
    assert list(tmp_path.iterdir()) == []


def test_load_refuses_incomplete_or_mismatched(tmp_path, cfg, base_params, tokenizer):
    with pytest.raises(FileNotFoundError, match="no exported model"):
        load_model(tmp_path / "absent")
    target = save_model(tmp_path / "model", base_params, cfg, tokenizer, {})
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "d_ff": 32}))
    with pytest.raises(CheckpointMismatchError, match="params do not match config.json"):
        load_model(target)
    (target / "config.json").write_text("{\n  oops")
    with pytest.raises(ValueError, match=r"config.json:2: invalid JSON"):
        load_model(target)
    (target / "meta.json").unlink()
    with pytest.raises(FileNotFoundError, match=rf"{target}: incomplete exported model, missing meta.json"):
        load_model(target)
