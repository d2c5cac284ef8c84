"""Write a needle model (or a LoRA adapter) as a GGUF file llama.cpp loads, with ``gguf.GGUFWriter``.

    write_gguf("out/model.gguf", params, cfg, tokenizer, "f16")     # f32 | f16 | bf16 | q8_0
    write_gguf_lora("out/adapter.gguf", lora_params, cfg, alpha)    # llama.cpp --lora

A model file holds ``general.architecture`` and its hyper-parameters (config.py), the tokenizer
and chat template (tokenizer.py) and every tensor in llama.cpp's names and layout (tensors.py).
As llama.cpp's own converter does, 1-D tensors (norms, biases) stay F32 and a matrix whose rows
are not a whole number of Q8_0 blocks (32 values) is written F16. An adapter file is llama.cpp's
LoRA format: ``general.type`` ``adapter``, ``adapter.type`` ``lora``, ``adapter.lora.alpha``, and
``blk.N.<tensor>.weight.lora_a`` ``[r, in]`` / ``.lora_b`` ``[out, r]`` (numpy layout); llama.cpp
scales by ``alpha / r`` as needle does. Files are written to a temp name and renamed into place.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import numpy as np

from needle.config import ModelConfig
from needle.model.gguf.config import gguf_metadata
from needle.model.gguf.tensors import _convert, gguf_name, params_to_gguf_tensors
from needle.model.gguf.tokenizer import tokenizer_metadata
from needle.model.lora import Params

GGUFType = Literal["f32", "f16", "bf16", "q8_0"]
# --type -> (ggml type name, general.file_type: llama.cpp's LlamaFileType)
TYPES: dict[str, tuple[str, int]] = {"f32": ("F32", 0), "f16": ("F16", 1), "bf16": ("BF16", 32), "q8_0": ("Q8_0", 7)}


def _add(writer: Any, key: str, value: Any) -> None:
    """One metadata value with the GGUF type llama.cpp expects for it (u32 ints, f32 floats)."""
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    else:
        writer.add_array(key, list(value))


def _encode(w: np.ndarray, type_name: str) -> tuple[np.ndarray, Any]:
    """``(data, raw ggml type or None)`` of one float32 tensor written as ``type_name``."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    if w.ndim == 1 or type_name == "F32":
        return w.astype(np.float32), None
    if type_name == "F16" or (type_name == "Q8_0" and w.shape[-1] % 32):
        return w.astype(np.float16), None
    qtype = GGMLQuantizationType[type_name]
    return quantize(w, qtype), qtype


def _write(path: str | Path, arch: str, metadata: dict[str, Any], tensors: dict[str, tuple[np.ndarray, Any]]) -> Path:
    from gguf import GGUFWriter

    target = Path(path).absolute()
    target.parent.mkdir(parents=True, exist_ok=True)
    staged = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        writer = GGUFWriter(str(staged), arch)
        for key, value in metadata.items():
            _add(writer, key, value)
        for name, (data, raw) in tensors.items():
            writer.add_tensor(name, data, raw_dtype=raw)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(staged, target)
    finally:
        staged.unlink(missing_ok=True)
    return target


def write_gguf(
    path: str | Path, params: Params, cfg: ModelConfig, tokenizer: Any, type_: GGUFType = "f16", name: str | None = None
) -> Path:
    """Write merged ``params`` of ``cfg`` with ``tokenizer`` as a llama.cpp model file; return its path."""
    if type_ not in TYPES:
        raise ValueError(f"unknown GGUF type {type_!r}; choose one of {', '.join(TYPES)}")
    type_name, file_type = TYPES[type_]
    arch, hparams = gguf_metadata(cfg)
    metadata = {"general.type": "model", "general.name": name or f"needle-{cfg.arch}", "general.file_type": file_type,
                "general.quantization_version": 2, **hparams, **tokenizer_metadata(tokenizer)}  # fmt: skip
    tensors = {n: _encode(w, type_name) for n, w in params_to_gguf_tensors(params, cfg).items()}
    return _write(path, arch, metadata, tensors)


def lora_tensors(lora_params: Params, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """``{blk.N.<tensor>.weight.lora_a|lora_b: float32}`` of needle's adapter leaves, in llama.cpp's layout."""
    from flax import traverse_util

    out = {}
    for path, leaf in traverse_util.flatten_dict(lora_params).items():
        if path[-1] not in ("lora_a", "lora_b"):
            continue
        block, kind, proj = path[-4:-1]
        module = {"attn": "self_attn", "mlp": "mlp"}[kind]
        name = gguf_name(f"model.layers.{block.removeprefix('block_')}.{module}.{proj}.weight", cfg.post_norms)
        # needle: x @ A @ B with A [in, r], B [r, out]; llama.cpp: A [r, in], B [out, r]. Only B's
        # rows are output rows, so only B takes llama's q/k row permutation (as convert_lora_to_gguf).
        w = np.asarray(leaf, np.float32).T
        out[f"{name}.{path[-1]}"] = _convert(name, w, cfg, undo=False) if path[-1] == "lora_b" else w
    if not out:
        raise ValueError("write_gguf_lora: the params have no lora_a/lora_b leaves")
    return out


def write_gguf_lora(path: str | Path, lora_params: Params, cfg: ModelConfig, alpha: float, name: str | None = None) -> Path:
    """Write the LoRA leaves of ``lora_params`` as a llama.cpp LoRA adapter file (``--lora``)."""
    arch, _ = gguf_metadata(cfg)
    metadata = {"general.type": "adapter", "general.name": name or f"needle-{cfg.arch}-lora",
                "adapter.type": "lora", "adapter.lora.alpha": float(alpha)}  # fmt: skip
    return _write(path, arch, metadata, {n: (w, None) for n, w in lora_tensors(lora_params, cfg).items()})
