"""``needle export MODEL OUT --format gguf [--type f16|bf16|q8_0|f32]``: a model for llama.cpp.

    needle export runs/tuned/model out/gguf --format gguf            # out/gguf/model.gguf (+ adapter.gguf)
    needle export runs/tuned/model tuned.gguf --format gguf --type q8_0
    llama-cli -m out/gguf/model.gguf                                   # or llama_cpp.Llama(model_path=...)
    llama-cli -m base.gguf --lora out/gguf/adapter.gguf                # the same model, adapter unmerged

OUT is a directory (``model.gguf`` inside, and ``adapter.gguf`` for a LoRA run) or a file name
ending in ``.gguf`` (the adapter then lands beside it as ``<name>.lora.gguf``). The model file is
the merged model (what needle evaluates and serves) with its tokenizer and chat template; the
adapter file is llama.cpp's LoRA format, to apply on the base the run was tuned from (a GGUF
base as it is; an HF or needle base exported with this same command first).
"""

from __future__ import annotations

from pathlib import Path

from needle.config import LoraConfig
from needle.errors import ModelImportError
from needle.model.gguf.writer import TYPES, GGUFType, write_gguf, write_gguf_lora
from needle.model.io import load_model
from needle.model.layout import ADAPTER_FILE as NEEDLE_ADAPTER, load_adapter

MODEL_FILE, ADAPTER_FILE = "model.gguf", "adapter.gguf"


def _targets(out: str | Path) -> tuple[Path, Path]:
    out = Path(out)
    if out.suffix.lower() == ".gguf":
        return out, out.with_name(f"{out.stem}.lora.gguf")
    return out / MODEL_FILE, out / ADAPTER_FILE


def export_gguf(model_dir: str | Path, out: str | Path, type_: GGUFType = "f16") -> list[Path]:
    """Write ``model_dir`` (any model ``load_model`` reads) as GGUF; return the files written."""
    if type_ not in TYPES:
        raise ModelImportError(f"--type {type_}: choose one of {', '.join(TYPES)}")
    loaded = load_model(model_dir)
    model_path, adapter_path = _targets(out)
    name = (loaded.meta.get("base") or {}).get("name") or Path(str(model_dir)).name
    try:
        files = [write_gguf(model_path, loaded.params, loaded.model_cfg, loaded.tokenizer, type_, name=name)]
    except ValueError as e:  # a tokenizer or config llama.cpp cannot take: the user's model, exit 2
        raise ModelImportError(f"{model_dir}: cannot be written as GGUF: {e}") from e
    lora = loaded.meta.get("lora")
    if lora and (Path(str(model_dir)) / NEEDLE_ADAPTER).is_file():
        alpha = LoraConfig.model_validate(lora).alpha
        files.append(write_gguf_lora(adapter_path, load_adapter(model_dir), loaded.model_cfg, alpha, name=f"{name}-lora"))
    return files
