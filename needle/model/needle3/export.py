"""`needle export MODEL --format needle OUT`: a Needle 3 fine-tune in Needle's own files.

``OUT`` receives::

    checkpoint.safetensors   the merged params as a format-2 checkpoint (cactus-needle's
                             ``load_checkpoint`` reads it; probe heads carried as they were)
    adapter.safetensors      a LoRA fine-tune's adapter in Needle's file format
                             (``lora/<path>/A|B``, metadata scale/base/rank/seed), for
                             cactus-needle's ``read_adapter``/``merge_lora``/``needle build --lora``
    model.cact               the on-device archive, written by cactus-needle's own ``write_export``
                             in its side virtualenv (needle/model/needle3/cactus_env.py) and read back there
    tokenizer.model          the SentencePiece model the archive embeds

    export_needle("runs/tuned/model", "out/needle")          # dict of the written paths
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from flax import traverse_util

from needle.errors import ModelImportError
from needle.model.io import load_model
from needle.model.layout import ADAPTER_FILE, load_adapter
from needle.model.needle3.cactus_env import run_in_cactus_env
from needle.model.needle3.checkpoint import write_needle3_checkpoint

CHECKPOINT = "checkpoint.safetensors"
ADAPTER = "adapter.safetensors"
ARCHIVE = "model.cact"
SP_MODEL = "tokenizer.model"
_WORKER = Path(__file__).with_name("cact_worker.py")
_ADAPTER_FIELDS = ("scale", "base", "rank", "seed", "pieces", "languages")


def needle_adapter_tensors(adapter: dict[str, Any]) -> dict[str, np.ndarray]:
    """needle's ``.../<proj>/lora_a|lora_b`` leaves as Needle's ``lora/.../<proj>/kernel/A|B`` tensors."""
    out: dict[str, np.ndarray] = {}
    for path, value in traverse_util.flatten_dict(adapter).items():
        leaf = {"lora_a": "A", "lora_b": "B"}.get(path[-1])
        if leaf is None:
            continue
        out[f"lora/{'/'.join(path[:-1])}/kernel/{leaf}"] = np.ascontiguousarray(np.asarray(value, np.float32))
    if not out:
        raise ModelImportError("the adapter holds no lora_a/lora_b leaves")
    return out


def write_needle_adapter(path: Path, adapter: dict[str, Any], meta: dict[str, Any]) -> Path:
    """Needle's adapter file (cactus-needle ``write_adapter``'s layout and metadata)."""
    from safetensors.numpy import save_file

    fields = {"pieces": None, "languages": None, **meta}
    metadata = {key: json.dumps(fields.get(key), default=str) for key in _ADAPTER_FIELDS}
    save_file(needle_adapter_tensors(adapter), str(path), metadata=metadata)
    return path


def write_cact(checkpoint: Path, sp_model: Path, out: Path, *, drop_confidence: bool) -> dict[str, Any]:
    """The ``.cact`` archive of ``checkpoint`` through cactus-needle's writer; its read-back summary."""
    with tempfile.TemporaryDirectory(prefix="needle-cact-") as tmp:
        spec = {"checkpoint": str(checkpoint), "sp_model": str(sp_model), "out": str(out),
                "drop_confidence": drop_confidence, "summary": os.path.join(tmp, "summary.json")}  # fmt: skip
        spec_path = Path(tmp, "spec.json")
        spec_path.write_text(json.dumps(spec))
        run_in_cactus_env(_WORKER, [str(spec_path)])
        return json.loads(Path(spec["summary"]).read_text())


def export_needle(model_dir: str | Path, out_dir: str | Path, *, archive: bool = True) -> dict[str, Path]:
    """Write a Needle 3 model directory (a fine-tune's, or a base) as Needle's files; return their paths."""
    loaded = load_model(model_dir)
    if loaded.model_cfg.arch != "needle3" or loaded.model_cfg.needle3 is None:
        raise ModelImportError(f"{model_dir}: a {loaded.model_cfg.arch} model; --format needle exports Needle 3 models only")
    out = Path(out_dir).absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    staged = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        n3 = loaded.model_cfg.needle3.model_dump(mode="json")
        n3["dtype"] = (loaded.meta.get("base") or {}).get("dtype") or n3["dtype"]  # the base's own, not training's
        params = traverse_util.unflatten_dict(
            {k: np.asarray(v, np.float32) for k, v in traverse_util.flatten_dict(loaded.params).items()}
        )
        run = {"source": "needle", "run_id": loaded.meta.get("run_id"), "base": (loaded.meta.get("base") or {}).get("source")}
        write_needle3_checkpoint(staged / CHECKPOINT, params, n3, step=int(loaded.meta.get("steps") or 0), run=run)
        sp_src = Path(model_dir) / SP_MODEL
        if not sp_src.is_file():
            loaded.tokenizer.save(staged)
        else:
            shutil.copyfile(sp_src, staged / SP_MODEL)
        lora = loaded.meta.get("lora")
        if lora and (Path(model_dir) / ADAPTER_FILE).is_file():
            base = loaded.meta.get("base") or {}
            write_needle_adapter(staged / ADAPTER, load_adapter(model_dir), {
                "scale": float(lora["alpha"]) / float(lora["rank"]), "base": base.get("checkpoint") or base.get("source"),
                "rank": int(lora["rank"]), "seed": int(loaded.meta.get("seed") or 0),
            })  # fmt: skip
        if archive:
            summary = write_cact(staged / CHECKPOINT, staged / SP_MODEL, staged / ARCHIVE, drop_confidence=bool(lora))
            (staged / "cact.json").write_text(json.dumps(summary, indent=2))
        if out.exists():
            shutil.rmtree(out)
        os.replace(staged, out)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    return {p.name: p for p in sorted(out.iterdir())}
