"""Import a ``.gguf`` file as a needle model: ``load_model("model.gguf")`` lands here.

Architecture and hyper-parameters come from the metadata (needle/model/gguf/config.py), the
weights dequantised to float32 in needle's layout (tensors.py), the tokenizer and chat template
from ``tokenizer.ggml.*`` (tokenizer.py). Everything that can be wrong with the file (not GGUF,
cut short, an architecture, tensor type, tokenizer or shape needle cannot take) is found before a
weight is dequantised and raised as ``ModelImportError`` naming the file, which the CLI reports
with exit 2 before any training.

    loaded = import_gguf_model("SmolLM2-135M-Instruct.Q4_1.gguf", max_len=2048)
    loaded.meta["base"]   # {"source": ..., "format": "gguf", "file_type": "Q4_1", "arch": "llama", ...}
    gguf_model_dir("model.gguf", "~/.cache/needle/gguf")   # the same, saved once as a needle model directory
"""

from __future__ import annotations

from pathlib import Path

from needle.errors import ModelImportError
from needle.model.factory import LoadedModel
from needle.model.gguf.config import gguf_to_hf_config
from needle.model.gguf.reader import read_gguf
from needle.model.gguf.tensors import check_tensors, load_gguf_params
from needle.model.gguf.tokenizer import gguf_tokenizer
from needle.model.hf.config import hf_config_to_model_config
from needle.model.hf.weights import checkpoint_n_params

# general.file_type (llama.cpp's LlamaFileType) of the common files, for the run record.
_FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K",
               12: "Q3_K_M", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K", 32: "BF16"}  # fmt: skip


def import_gguf_model(path: str | Path, *, max_len: int | None = None) -> LoadedModel:
    """Read ``path`` (a GGUF model file) into params, ``ModelConfig``, tokenizer and ``meta["base"]``."""
    f = read_gguf(path)
    kind = f.metadata.get("general.type", "model")
    if kind != "model":
        raise f.fail(f"general.type is {kind!r}: a LoRA adapter or other non-model GGUF cannot be a base model")
    hf = gguf_to_hf_config(f)
    try:
        cfg = hf_config_to_model_config(hf, max_len=max_len)
    except ModelImportError as e:  # name the GGUF file, not the config dict made from it
        raise f.fail(str(e).removeprefix("config.json: ")) from e
    check_tensors(f, cfg)
    tokenizer = gguf_tokenizer(f)
    if tokenizer.vocab_size > cfg.vocab_size:
        raise f.fail(f"the tokenizer has {tokenizer.vocab_size} tokens but the embedding only {cfg.vocab_size} rows")
    params = load_gguf_params(f, cfg)
    file_type = f.metadata.get("general.file_type")
    base = {
        "source": str(f.path), "revision": None, "commit": None, "format": "gguf", "arch": cfg.arch,
        "file_type": _FILE_TYPES.get(file_type, file_type), "name": f.metadata.get("general.name"),
        "n_params": checkpoint_n_params(cfg),
    }  # fmt: skip
    return LoadedModel(params=params, model_cfg=cfg, tokenizer=tokenizer, meta={"base": base})
