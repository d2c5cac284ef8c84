"""Needle 3 bases reach ``load_model`` in every layout a user has: the hub repository's, a single
checkpoint with its tokenizer beside it, ``hf:`` (offline: one clear error), and a checkpoint
without probe heads (cactus-needle's plain ``init``)."""

from __future__ import annotations

import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from needle.data.sample import generate_rows, write_rows
from needle.errors import ModelImportError
from needle.model.factory import module_for
from needle.model.io import load_model
from needle.model.needle3.checkpoint import read_needle3_checkpoint, write_needle3_checkpoint
from needle.model.needle3.random_model import write_random_needle3


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("n3io")
    rows = write_rows(root / "rows.jsonl", generate_rows(60, "new", seed=5))
    return write_random_needle3(root / "repo", data=rows, seed=2)


def _logits(loaded, ids: np.ndarray) -> np.ndarray:
    return np.asarray(module_for(loaded.model_cfg).apply({"params": loaded.params}, jnp.asarray(ids)))


def test_repo_layout_and_single_file_load_the_same_model(repo: Path, tmp_path: Path) -> None:
    from_repo = load_model(repo)
    single = tmp_path / "mine.safetensors"
    shutil.copyfile(repo / "checkpoints" / "needle3.safetensors", single)
    shutil.copyfile(repo / "tokenizer" / "tokenizer.model", tmp_path / "tokenizer.model")
    from_file = load_model(single)
    assert from_repo.model_cfg == from_file.model_cfg and from_repo.model_cfg.arch == "needle3"
    assert from_file.meta["base"]["source"] == str(single) and from_file.meta["base"]["n_params"] > 0
    ids = np.asarray([from_repo.tokenizer.encode("<tool_call>[{\"name\":")], np.int32)
    np.testing.assert_array_equal(_logits(from_repo, ids), _logits(from_file, ids))


def test_checkpoint_without_its_tokenizer_names_where_it_looked(repo: Path, tmp_path: Path) -> None:
    lone = tmp_path / "lone.safetensors"
    shutil.copyfile(repo / "checkpoints" / "needle3.safetensors", lone)
    with pytest.raises(ModelImportError, match=r"lone\.safetensors: no Needle tokenizer found"):
        load_model(lone)


def test_hub_id_offline_fails_at_once_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelImportError, match="hf:Cactus-Compute/needle3"):
        load_model("hf:Cactus-Compute/needle3")


def test_checkpoint_without_probe_heads_gets_them_and_the_same_logits(repo: Path, tmp_path: Path) -> None:
    params, config, _ = read_needle3_checkpoint(repo / "checkpoints" / "needle3.safetensors")
    bare = {k: v for k, v in params.items() if not k.endswith("_head")}
    assert len(bare) < len(params)
    (tmp_path / "checkpoints").mkdir()
    shutil.copytree(repo / "tokenizer", tmp_path / "tokenizer")
    write_needle3_checkpoint(tmp_path / "checkpoints" / "needle3.safetensors", bare, config)
    loaded, full = load_model(tmp_path), load_model(repo)
    assert sorted(loaded.meta["base"]["heads_filled"]) == ["confidence_head", "embedding_head", "router_head"]
    ids = np.asarray([full.tokenizer.encode("send a text")], np.int32)
    np.testing.assert_array_equal(_logits(loaded, ids), _logits(full, ids))
