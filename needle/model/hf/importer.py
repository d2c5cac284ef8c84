"""A Hugging Face model (directory or ``hf:owner/name[@revision]``) as a needle base.

``load_model`` (needle/model/io.py) dispatches here for a directory with a ``config.json`` that
names a ``model_type`` and safetensors weights: the params (needle/model/hf/weights.py), a
``ModelConfig`` (needle/model/hf/config.py), the model's own tokenizer and ``meta["base"]``
(source, revision, arch, n_params).
"""

from __future__ import annotations

from pathlib import Path

from needle.errors import ModelImportError
from needle.model.factory import LoadedModel
from needle.model.hf.config import hf_config_to_model_config, resolve_model_source
from needle.model.hf.weights import checkpoint_n_params, load_hf_params
from needle.model.layout import CONFIG_FILE, TOKENIZER_FILE
from needle.tokenizers.load import load_tokenizer


def import_hf_model(spec: str | Path, *, max_len: int | None = None) -> LoadedModel:
    """Import a Hugging Face model (directory or ``hf:`` id): params, config, tokenizer, base meta."""
    src = resolve_model_source(spec)
    cfg = hf_config_to_model_config(src.path / CONFIG_FILE, max_len=max_len)
    if not (src.path / TOKENIZER_FILE).is_file():
        raise ModelImportError(f"{src.path}: no {TOKENIZER_FILE}: needle needs the model's own tokenizer")
    tokenizer = load_tokenizer(src.path)
    if tokenizer.vocab_size > cfg.vocab_size:
        raise ModelImportError(
            f"{src.path}: {TOKENIZER_FILE} has {tokenizer.vocab_size} tokens but the embedding only "
            f"{cfg.vocab_size} rows (config.json vocab_size): tokenizer and weights do not belong together"
        )
    params = load_hf_params(src.path, cfg)
    base = {**src.as_meta(), "arch": cfg.arch, "n_params": checkpoint_n_params(cfg)}
    return LoadedModel(params=params, model_cfg=cfg, tokenizer=tokenizer, meta={"base": base})
