"""Configs: presets, validation, unknown keys rejected, flattening."""

import pytest
from pydantic import ValidationError

from needle.config import (
    IMPORTED_MAX_LEN,
    DataConfig,
    LoraConfig,
    ModelConfig,
    TrainConfig,
    data_config,
    flatten_config,
    imported_max_len,
    lora_config,
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


def test_one_imported_context_rule():
    # Hugging Face (max_position_embeddings), GGUF and Needle 3 (max_seq_len) bases all take it.
    assert imported_max_len(None, None) == IMPORTED_MAX_LEN == 2048
    assert imported_max_len(None, 128) == 128 and imported_max_len(4096, 8192) == 4096
    assert imported_max_len(4096, 1024) == 1024  # capped by the model, never past it


def test_the_lora_config_exists_in_lora_mode_only():
    assert lora_config("full", {"rank": 4}) is None and lora_config("scratch") is None
    assert lora_config("lora") == LoraConfig() and lora_config("lora", {"rank": 4}).rank == 4
    assert lora_config("lora", LoraConfig(alpha=8.0)).alpha == 8.0
    with pytest.raises(ValidationError):
        lora_config("lora", {"rnak": 4})


def test_max_len_is_the_longest_row_at_every_entry_point():
    tiny = model_preset("tiny")
    assert data_config("rows.jsonl", tiny).max_len == tiny.max_len
    assert data_config("rows.jsonl", tiny, 128, "drop") == DataConfig(source="rows.jsonl", max_len=128, on_error="drop")


def test_needle_train_builds_its_configs_as_the_flow_does(monkeypatch, tmp_path):
    """`needle train` and the flow's FinetuneParams go through the same functions: the same
    options give the same DataConfig, TrainConfig, OptimConfig and LoraConfig."""
    from types import SimpleNamespace

    from needle import cli, pipeline
    from needle_flows.params import FinetuneParams

    seen: dict = {}
    tiny = model_preset("tiny")
    base = SimpleNamespace(model_cfg=tiny, tokenizer=None)
    monkeypatch.setattr(pipeline, "load_data", lambda data, on_error: None)
    monkeypatch.setattr(pipeline, "obtain_base", lambda spec, preset=None, max_len=None: base)
    monkeypatch.setattr(pipeline, "prepare_data", lambda data_cfg, *a, **k: seen.setdefault("data", data_cfg))

    def train(prepared, model_cfg, train_cfg, optim_cfg, lora_cfg, **kwargs):
        seen.update(train=train_cfg, optim=optim_cfg, lora=lora_cfg)
        raise SystemExit(0)  # stop before the summary: only the configs matter here

    monkeypatch.setattr(pipeline, "train", train)
    with pytest.raises(SystemExit):
        cli.main(["train", "rows.jsonl", "--out", str(tmp_path / "out"), "--base", str(tmp_path), "--steps", "3",
                  "--batch-size", "4", "--max-len", "200", "--lora-rank", "4", "--lora-alpha", "8",
                  "--lora-targets", "q,v", "--on-error", "drop"])  # fmt: skip
    p = FinetuneParams(data="rows.jsonl", steps=3, batch_size=4, max_len=200, on_error="drop",
                       lora={"rank": 4, "alpha": 8, "targets": ["q", "v"]})  # fmt: skip
    assert (seen["train"], seen["optim"]) == p.training_configs()
    assert seen["lora"] == lora_config(p.mode, p.lora) and seen["lora"].rank == 4
    assert seen["data"].max_len == p.data_config("rows.jsonl", tiny).max_len == 200
