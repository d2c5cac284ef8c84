"""The exported model directory's layout and what every reader and writer of it shares.

The lowest model-file layer (it imports no other model module): file names, the atomic swap
into place and the LoRA adapter file. needle/model/io.py (save and load, and the dispatch to the
Hugging Face, Needle 3 and GGUF importers) and every family's importer and exporter import these
from here. ``LoadedModel`` and ``abstract_params`` are needle/model/factory.py's.

Layout of a model directory::

    params/              orbax StandardCheckpointer tree, base layout (no LoRA leaves), float32
    config.json          ModelConfig.model_dump()
    tokenizer.json       the tokenizer (tokenizer.model: Needle 3's SentencePiece model)
    meta.json            free-form JSON metadata (run id, data fingerprint, metrics, ...)
    adapter.safetensors  a LoRA run's unmerged lora_a/lora_b leaves (PEFT and Needle exports)
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import numpy as np
from flax import traverse_util

from needle.errors import ModelImportError

PARAMS_DIR = "params"
CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_FILES = (TOKENIZER_FILE, "tokenizer.model")  # tokenizers' JSON, or Needle 3's SentencePiece model
META_FILE = "meta.json"
REQUIRED = (PARAMS_DIR, CONFIG_FILE, TOKENIZER_FILE, META_FILE)


ADAPTER_FILE = "adapter.safetensors"


def save_adapter(lora_params: dict[str, Any], model_dir: str | Path) -> Path:
    """Write the adapter leaves of ``lora_params`` (other leaves are ignored) as safetensors."""
    from safetensors.numpy import save_file

    flat = traverse_util.flatten_dict(lora_params)
    tensors = {"/".join(k): np.asarray(v, np.float32) for k, v in flat.items() if k[-1] in ("lora_a", "lora_b")}
    if not tensors:
        raise ValueError("save_adapter: no lora_a/lora_b leaves in these params")
    path = Path(model_dir) / ADAPTER_FILE
    save_file(tensors, str(path), metadata={"format": "needle-lora"})
    return path


def load_adapter(model_dir: str | Path) -> dict[str, Any]:
    """The adapter leaves saved by :func:`save_adapter`, as a nested params tree."""
    from safetensors.numpy import load_file

    path = Path(model_dir) / ADAPTER_FILE
    if not path.is_file():
        raise ModelImportError(f"{model_dir}: no {ADAPTER_FILE}: only a LoRA run's model has an adapter to export")
    return traverse_util.unflatten_dict({tuple(k.split("/")): v for k, v in load_file(str(path)).items()})


def _swap_in(staged: Path, target: Path) -> None:
    """Rename ``staged`` to ``target``; an existing model is moved aside first, then deleted."""
    if not target.exists():
        os.replace(staged, target)
        return
    old = target.with_name(f".{target.name}.old-{uuid.uuid4().hex[:8]}")
    os.replace(target, old)
    os.replace(staged, target)
    shutil.rmtree(old)
