"""The LoRA adapter kept beside a tuned model, and `needle export` to Hugging Face, PEFT or Needle.

A LoRA run's exported model directory holds the merged params (what eval and serving load) and,
in ``adapter.safetensors``, the unmerged ``lora_a``/``lora_b`` leaves under their needle paths
(``block_0/attn/q_proj/lora_a``), so the adapter can be written out for the original base later.

    needle export runs/tuned/model --format hf   out/hf     # transformers loads it
    needle export runs/tuned/model --format peft out/peft   # PeftModel.from_pretrained(base, out/peft)
    needle export models:/needle@champion --format hf out/hf
    needle export runs/tuned/model --format needle out/n3  # Needle 3: checkpoint, adapter, .cact
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import numpy as np
from flax import traverse_util

from needle.errors import ModelImportError
from needle.model.lora import Params

ADAPTER_FILE = "adapter.safetensors"
ExportFormat = Literal["hf", "peft", "needle"]


def save_adapter(lora_params: Params, model_dir: str | Path) -> Path:
    """Write the adapter leaves of ``lora_params`` (other leaves are ignored) as safetensors."""
    from safetensors.numpy import save_file

    flat = traverse_util.flatten_dict(lora_params)
    tensors = {"/".join(k): np.asarray(v, np.float32) for k, v in flat.items() if k[-1] in ("lora_a", "lora_b")}
    if not tensors:
        raise ValueError("save_adapter: no lora_a/lora_b leaves in these params")
    path = Path(model_dir) / ADAPTER_FILE
    save_file(tensors, str(path), metadata={"format": "needle-lora"})
    return path


def load_adapter(model_dir: str | Path) -> Params:
    """The adapter leaves saved by :func:`save_adapter`, as a nested params tree."""
    from safetensors.numpy import load_file

    path = Path(model_dir) / ADAPTER_FILE
    if not path.is_file():
        raise ModelImportError(f"{model_dir}: no {ADAPTER_FILE}: only a LoRA run's model has an adapter to export")
    return traverse_util.unflatten_dict({tuple(k.split("/")): v for k, v in load_file(str(path)).items()})


def base_source_of(meta: dict[str, Any]) -> dict[str, Any]:
    """The base a PEFT adapter names: the hub id and revision when it came from the hub, else its path."""
    base = meta.get("base") or {}
    source = base.get("source") or meta.get("base_model_dir")
    if not source:
        raise ModelImportError("the model's meta.json does not say which base it was trained on")
    return {**base, "source": str(source)}


def export_model(location: str, fmt: ExportFormat, out_dir: str | Path) -> Path:
    """Export a model (directory, ``models:/`` URI, or Hugging Face directory) as ``hf`` or ``peft``."""
    from needle.config import LoraConfig
    from needle.model.hf_export import export_hf, export_peft
    from needle.model.io import load_model
    from needle.registry import resolve_model_dir

    model_dir = resolve_model_dir(location) if not location.startswith("hf:") else location
    if fmt == "needle":
        from needle.model.needle3_export import export_needle

        export_needle(model_dir, out_dir)
        return Path(out_dir)
    if fmt == "hf":
        return export_hf(load_model(model_dir), None, None, out_dir)
    if fmt != "peft":
        raise ValueError(f"unknown export format {fmt!r}; choose 'hf', 'peft' or 'needle'")
    loaded = load_model(model_dir)
    if not loaded.meta.get("lora"):
        raise ModelImportError(f"{location}: not a LoRA fine-tune (meta.json has no lora config): nothing to export as PEFT")
    lora_cfg = LoraConfig.model_validate(loaded.meta["lora"])
    return export_peft(load_adapter(model_dir), lora_cfg, base_source_of(loaded.meta), out_dir)


def export_run_model(model_dir: str | Path, out_root: str | Path) -> dict[str, Path]:
    """The exports a run logs: ``hf`` always, ``peft`` for a LoRA run on an imported base."""
    from needle.model.io import load_model

    out = Path(out_root)
    if load_model(model_dir).model_cfg.arch == "needle3":  # Needle's own files; transformers has no Needle 3
        return {"needle": export_model(str(model_dir), "needle", out / "needle")}
    paths = {"hf": export_model(str(model_dir), "hf", out / "hf")}
    meta = load_model(model_dir).meta if (Path(model_dir) / ADAPTER_FILE).is_file() else {}
    if meta.get("lora") and meta.get("base"):  # a PEFT adapter needs a base that transformers loads
        paths["peft"] = export_model(str(model_dir), "peft", out / "peft")
    return paths
