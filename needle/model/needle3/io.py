"""Needle 3 bases in: a cactus-needle checkpoint, its hub repository's layout, or ``hf:`` id.

A Needle 3 base is what a snapshot of ``Cactus-Compute/needle3`` holds::

    checkpoints/NAME.safetensors      format-version-2 checkpoint (config JSON in its metadata)
    tokenizer/tokenizer.model         SentencePiece model with Needle's fixed special ids

``load_model`` (needle/model/io.py) hands such a directory, a single ``.safetensors`` checkpoint
(its tokenizer found beside it: ``tokenizer.model``, ``tokenizer/tokenizer.model`` or the hub
layout's ``../tokenizer/tokenizer.model``) or ``hf:OWNER/NAME`` for a Needle repository to
:func:`import_needle3_model`, which returns the same ``LoadedModel`` as every other family:
params (the reference's tree, probe heads included), a ``ModelConfig`` with ``arch="needle3"``
and the ``Needle3Config`` from the checkpoint, the tokenizer and ``meta["base"]``.

    loaded = load_model("needle3-snapshot/")                 # or "ckpt.safetensors", "hf:Cactus-Compute/needle3"
    logits = module_for(loaded.model_cfg).apply({"params": loaded.params}, ids)
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import jax
import numpy as np

from needle.config import ModelConfig, Needle3Config, imported_max_len
from needle.errors import ModelImportError
from needle.model.factory import LoadedModel, module_for
from needle.model.hf.config import download_snapshot
from needle.model.needle3.architecture import check_supported
from needle.model.needle3.checkpoint import needle3_model_config, read_needle3_checkpoint
from needle.tokenizers.load import load_tokenizer

log = logging.getLogger("needle")

CHECKPOINTS_DIR = "checkpoints"
TOKENIZER_DIR = "tokenizer"
SP_MODEL_FILE = "tokenizer.model"
DEFAULT_CHECKPOINT = "needle3.safetensors"  # cactus-needle's DEFAULT_BASE names this file
# What snapshot_download fetches of a Needle repository.
ALLOW_PATTERNS = [f"{CHECKPOINTS_DIR}/*.safetensors", f"{TOKENIZER_DIR}/*", "*.safetensors", SP_MODEL_FILE]
def is_needle3_source(spec: str | Path) -> bool:
    """True for a ``.safetensors`` file or a directory laid out as a Needle 3 hub repository."""
    p = Path(spec)
    if p.is_file():
        return p.suffix == ".safetensors" or _looks_like_pickle(p)
    return p.is_dir() and (p / CHECKPOINTS_DIR).is_dir() and not (p / "config.json").is_file()


def _looks_like_pickle(path: Path) -> bool:
    # A torch/pickle checkpoint handed where a Needle checkpoint belongs: refused by name, never read.
    return path.suffix in (".pt", ".pth", ".bin", ".pkl", ".ckpt")


def needle3_config(raw: dict[str, Any], where: str) -> Needle3Config:
    """A Needle 3 config (a checkpoint's, or a sample shape) validated; unsupported switches refused by name."""
    try:
        n3 = Needle3Config.model_validate(raw)
        check_supported(n3)
    except ValueError as e:
        raise ModelImportError(f"{where}: unsupported Needle 3 config: {e}") from e
    return n3


def model_config_of(n3: Needle3Config, max_len: int | None = None) -> ModelConfig:
    """needle's ``ModelConfig`` for a Needle 3 base: context ``max_len`` (``needle.config.imported_max_len``:
    default 2048, capped by the model's ``max_seq_len``)."""
    return needle3_model_config(n3, imported_max_len(max_len, n3.max_seq_len))


def find_checkpoint(root: Path) -> Path:
    """The base checkpoint of a Needle repository directory (``checkpoints/needle3.safetensors``, or the only one)."""
    ckpts = sorted((root / CHECKPOINTS_DIR).glob("*.safetensors"))
    named = [p for p in ckpts if p.name == DEFAULT_CHECKPOINT]
    if named:
        return named[0]
    if len(ckpts) == 1:
        return ckpts[0]
    if not ckpts:
        raise ModelImportError(f"{root / CHECKPOINTS_DIR}: no .safetensors checkpoint here")
    names = ", ".join(p.name for p in ckpts)
    raise ModelImportError(f"{root / CHECKPOINTS_DIR}: several checkpoints ({names}); pass the file itself as the base")


def find_sp_model(checkpoint: Path) -> Path:
    """The SentencePiece model that belongs with ``checkpoint`` (beside it, or the hub layout's)."""
    here = checkpoint.parent
    for cand in (here / SP_MODEL_FILE, here / TOKENIZER_DIR / SP_MODEL_FILE, here.parent / TOKENIZER_DIR / SP_MODEL_FILE):
        if cand.is_file():
            return cand
    raise ModelImportError(
        f"{checkpoint}: no Needle tokenizer found ({SP_MODEL_FILE} beside it, in {TOKENIZER_DIR}/, or in "
        f"../{TOKENIZER_DIR}/ as the hub repository lays it out); needle needs the model's own tokenizer"
    )


def _resolve(spec: str | Path) -> tuple[Path, dict[str, Any]]:
    text = str(spec)
    if text.startswith("hf:"):
        src = download_snapshot(text, ALLOW_PATTERNS)
        return find_checkpoint(src.path), src.as_meta()
    path = Path(text).expanduser().absolute()
    if path.is_dir():
        return find_checkpoint(path), {"source": str(path), "revision": None, "commit": None}
    if not path.is_file():
        raise ModelImportError(f"{path}: no such Needle 3 checkpoint or directory")
    return path, {"source": str(path), "revision": None, "commit": None}


def import_needle3_model(spec: str | Path, *, max_len: int | None = None) -> Any:
    """Import a Needle 3 base (file, repository directory or ``hf:`` id) as a ``LoadedModel``."""
    ckpt, source = _resolve(spec)
    if _looks_like_pickle(ckpt) or ckpt.suffix != ".safetensors":
        raise ModelImportError(f"{ckpt}: not a .safetensors file; Needle checkpoints are safetensors and needle never unpickles")
    params, raw_cfg, metadata = read_needle3_checkpoint(ckpt)
    n3 = needle3_config(raw_cfg, str(ckpt))
    # Fine-tuning computes in float32, as cactus-needle's finetune does; the export writes the
    # checkpoint's own dtype back (meta base.dtype).
    cfg = model_config_of(n3.model_copy(update={"dtype": "float32"}), max_len)
    sp = find_sp_model(ckpt)
    tokenizer = load_tokenizer(sp.parent)
    if tokenizer.vocab_size > n3.vocab_size:
        raise ModelImportError(
            f"{sp}: {tokenizer.vocab_size} pieces but the checkpoint's vocab_size is {n3.vocab_size}: "
            "tokenizer and weights do not belong together"
        )
    n_params = int(sum(np.prod(np.shape(x)) for x in jax.tree.leaves(params)))
    base = {**source, "arch": "needle3", "n_params": n_params, "checkpoint": str(ckpt), "dtype": n3.dtype,
            "step": metadata.get("step"), "run": metadata.get("run")}  # fmt: skip
    params = jax.tree.map(lambda a: jax.numpy.asarray(np.asarray(a, np.float32)), params)
    filled = _fill_probe_heads(params, cfg)
    if filled:
        base["heads_filled"] = filled
        log.warning("%s has no %s: filled with a fresh init (the LM forward does not read them)", ckpt, ", ".join(filled))
    return LoadedModel(params=params, model_cfg=cfg, tokenizer=tokenizer, meta={"base": base})


PROBE_HEADS = ("embedding_head", "confidence_head", "router_head")


def _fill_probe_heads(params: dict[str, Any], cfg: ModelConfig) -> list[str]:
    """A checkpoint made by cactus-needle's plain ``init`` (a pretraining start, a stand-in) has no probe
    heads; a trained one has all three. Missing heads get the module's deterministic init, in place."""
    missing = [h for h in PROBE_HEADS if h not in params]
    if missing:
        fresh = module_for(cfg).init(jax.random.key(0), jax.numpy.zeros((1, 8), jax.numpy.int32))["params"]
        params.update({h: fresh[h] for h in missing})
    return missing
