"""The LoRA adapter kept beside a tuned model, and `needle export` to Hugging Face, PEFT or Needle.

A LoRA run's exported model directory holds the merged params (what eval and serving load) and,
in ``adapter.safetensors``, the unmerged ``lora_a``/``lora_b`` leaves under their needle paths
(``block_0/attn/q_proj/lora_a``), so the adapter can be written out for the original base later.

    needle export runs/tuned/model --format hf   out/hf     # transformers loads it
    needle export runs/tuned/model --format peft out/peft   # PeftModel.from_pretrained(base, out/peft)
    needle export models:/needle@champion --format hf out/hf
    needle export runs/tuned/model --format needle out/n3  # Needle 3: checkpoint, adapter, .cact
    needle export runs/tuned/model --format gguf out/gguf  # llama.cpp: model.gguf (+ adapter.gguf)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from needle.config import LoraConfig
from needle.errors import ModelImportError
from needle.model.gguf.export import export_gguf
from needle.model.hf.export import export_hf, export_peft
from needle.model.io import load_model
from needle.model.layout import ADAPTER_FILE, load_adapter
from needle.model.needle3.export import export_needle
from needle.registry import resolve_model_dir

ExportFormat = Literal["hf", "peft", "needle", "gguf"]


def base_source_of(meta: dict[str, Any]) -> dict[str, Any]:
    """The base a PEFT adapter names: the hub id and revision when it came from the hub, else its path."""
    base = meta.get("base") or {}
    source = base.get("source") or meta.get("base_model_dir")
    if not source:
        raise ModelImportError("the model's meta.json does not say which base it was trained on")
    return {**base, "source": str(source)}


def export_model(location: str, fmt: ExportFormat, out_dir: str | Path, gguf_type: str = "f16") -> Path:
    """Export a model (directory, ``models:/`` URI, Hugging Face directory or GGUF file) as
    ``hf``, ``peft``, ``needle`` or ``gguf`` (``gguf_type``: f16, bf16, q8_0, f32)."""
    model_dir = resolve_model_dir(location) if not location.startswith("hf:") else location
    if fmt == "needle":
        export_needle(model_dir, out_dir)
        return Path(out_dir)
    if fmt == "gguf":
        return export_gguf(model_dir, out_dir, gguf_type)[0]  # type: ignore[arg-type]
    if fmt == "hf":
        return export_hf(load_model(model_dir), None, None, out_dir)
    if fmt != "peft":
        raise ValueError(f"unknown export format {fmt!r}; choose 'hf', 'peft', 'needle' or 'gguf'")
    loaded = load_model(model_dir)
    if not loaded.meta.get("lora"):
        raise ModelImportError(f"{location}: not a LoRA fine-tune (meta.json has no lora config): nothing to export as PEFT")
    lora_cfg = LoraConfig.model_validate(loaded.meta["lora"])
    return export_peft(load_adapter(model_dir), lora_cfg, base_source_of(loaded.meta), out_dir)


def export_run_model(model_dir: str | Path, out_root: str | Path) -> dict[str, Path]:
    """The exports a run logs: ``hf`` always, ``peft`` for a LoRA run on an imported base, ``gguf``
    (model.gguf, f16, and adapter.gguf) for a run on a GGUF base."""
    out = Path(out_root)
    loaded = load_model(model_dir)
    if loaded.model_cfg.arch == "needle3":  # Needle's own files; transformers has no Needle 3
        return {"needle": export_model(str(model_dir), "needle", out / "needle")}
    paths = {"hf": export_model(str(model_dir), "hf", out / "hf")}
    meta = loaded.meta
    if meta.get("lora") and meta.get("base") and (Path(model_dir) / ADAPTER_FILE).is_file():
        paths["peft"] = export_model(str(model_dir), "peft", out / "peft")  # needs a base transformers loads
    if (meta.get("base") or {}).get("format") == "gguf":  # came as GGUF, goes back as GGUF (+ its LoRA)
        paths["gguf"] = export_model(str(model_dir), "gguf", out / "gguf").parent
    return paths
