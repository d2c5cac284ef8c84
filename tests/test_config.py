"""Configs: presets, validation, unknown keys rejected, flattening."""

import pytest
from pydantic import ValidationError

from needle.config import (
    DataConfig,
    LoraConfig,
    ModelConfig,
    TrainConfig,
    flatten_config,
    model_preset,
    preset_names,
)


def test_presets_exist_and_validate():
    assert {"tiny", "small", "needle-45m"} <= set(preset_names())
    tiny = model_preset("tiny")
    assert tiny.d_model == 32 and tiny.n_layers == 2 and tiny.preset == "tiny"
    assert model_preset("tiny", n_layers=3).n_layers == 3


def test_unknown_keys_are_errors():
    with pytest.raises(ValidationError, match="stepz"):
        TrainConfig(stepz=3)
    with pytest.raises(ValidationError):
        model_preset("tiny", d_modle=64)
    with pytest.raises(ValidationError):
        TrainConfig.model_validate({"steps": 10, "learning_rate": 1.0})


def test_unknown_preset_names_the_choices():
    with pytest.raises(ValueError, match="tiny"):
        model_preset("huge")


def test_invalid_values_rejected():
    with pytest.raises(ValidationError):
        ModelConfig(d_model=30, n_heads=4)
    with pytest.raises(ValidationError):
        ModelConfig(n_heads=4, n_kv_heads=3)
    with pytest.raises(ValidationError):
        TrainConfig(batch_size=10, grad_accum=3)
    with pytest.raises(ValidationError):
        LoraConfig(targets=("q", "nope"))
    with pytest.raises(ValidationError):
        DataConfig()  # source is required


def test_flatten_config_dotted_keys():
    flat = flatten_config({"lora": LoraConfig(rank=4), "model": {"preset": "tiny"}})
    assert flat["lora.rank"] == 4
    assert flat["model.preset"] == "tiny"
    assert flat["lora.targets"] == ["q", "k", "v", "o", "gate", "up", "down"]
