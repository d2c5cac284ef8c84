"""The exported model directory: merged params (orbax) + config + tokenizer + metadata.

Layout of ``model_dir``::

    params/          orbax StandardCheckpointer tree, base layout (no LoRA leaves), float32
    config.json      ModelConfig.model_dump()
    tokenizer.json   needle.tokenizers.native.Tokenizer.save(model_dir) (tokenizer.model for Needle 3)
    meta.json        free-form JSON metadata (run id, data fingerprint, metrics, ...)

``load_model`` also reads a Needle 3 base (needle/model/needle3/io.py: a cactus-needle
checkpoint, its hub repository's layout or ``hf:`` id) and a Hugging Face model directory (``config.json`` with a ``model_type``
and safetensors weights) or a hub id ``hf:owner/name[@revision]`` (needle/model/hf/config.py): it
imports params, a ``ModelConfig``, the model's own tokenizer and ``meta["base"]``
(source, revision, arch, n_params); a GGUF file (needle/model/gguf/) likewise. A model of an imported architecture saved with
``save_model`` is a native directory like any other (its config.json carries the switches and
the original HF config in ``hf_config``).

Everything is written into a hidden sibling temp directory that is renamed into place only when
complete, so a crash never leaves a half-written model at ``model_dir``. Eval, predict and the
registry read it back with :func:`load_model`; ``module_for(cfg)`` (a LoRA-free module of its family) applies the params.

    save_model("out/model", merge_lora(params, lora), cfg, tokenizer, {"run_id": "..."})
    loaded = load_model("out/model")
    logits = module_for(loaded.model_cfg).apply({"params": loaded.params}, tokens)
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from flax import traverse_util

from needle.config import ModelConfig
from needle.errors import CheckpointMismatchError, ModelNotFoundError
from needle.model.factory import LoadedModel, abstract_params
from needle.model.gguf.importer import import_gguf_model
from needle.model.gguf.reader import is_gguf_file
from needle.model.hf.config import ALLOW_PATTERNS as HF_PATTERNS, download_snapshot, is_hf_model_dir
from needle.model.hf.importer import import_hf_model
from needle.model.layout import (
    CONFIG_FILE, META_FILE, PARAMS_DIR, REQUIRED, TOKENIZER_FILE, TOKENIZER_FILES, _swap_in, save_adapter,
)  # fmt: skip
from needle.model.lora import LORA_LEAVES, Params
from needle.model.needle3.io import ALLOW_PATTERNS as NEEDLE3_PATTERNS, import_needle3_model, is_needle3_source
from needle.tokenizers.load import load_tokenizer


def _check_layout(params: Params, cfg: ModelConfig) -> None:
    flat = traverse_util.flatten_dict(params)
    lora = sorted("/".join(k) for k in flat if k[-1] in LORA_LEAVES)
    if lora:
        raise ValueError(f"save_model: params still hold LoRA leaves (merge_lora first), e.g. {lora[:3]}")
    want = traverse_util.flatten_dict(abstract_params(cfg))
    problems = [f"missing {'/'.join(k)}" for k in sorted(want.keys() - flat.keys())]
    problems += [f"unexpected {'/'.join(k)}" for k in sorted(flat.keys() - want.keys())]
    problems += [
        f"{'/'.join(k)}: shape {tuple(flat[k].shape)} != {want[k].shape}"
        for k in sorted(want.keys() & flat.keys())
        if tuple(flat[k].shape) != want[k].shape
    ]
    if problems:
        raise CheckpointMismatchError("save_model: params do not match the model config:\n  " + "\n  ".join(problems))


def _local_checkpointer() -> ocp.StandardCheckpointer:
    """A checkpointer that reads or writes in this process alone: a model directory is whole host
    arrays, and under ``jax.distributed`` process 0 writes it while the others do not take part."""
    me = jax.process_index()
    return ocp.StandardCheckpointer(
        multiprocessing_options=ocp.options.MultiprocessingOptions(primary_host=me, active_processes={me})
    )


def save_model(
    model_dir: str | Path, params: Params, model_cfg: ModelConfig, tokenizer: Any, meta: dict[str, Any],
    adapter: Params | None = None,
) -> Path:
    """Write an exported model to ``model_dir`` atomically (replacing any previous one); return it.

    ``adapter``: the unmerged LoRA leaves, kept as ``adapter.safetensors`` for a PEFT export.
    """
    target = Path(model_dir).absolute()
    _check_layout(params, model_cfg)
    vocab = getattr(tokenizer, "vocab_size", None)
    if vocab is not None and vocab > model_cfg.vocab_size:
        raise ValueError(f"save_model: tokenizer has {vocab} tokens but the model only {model_cfg.vocab_size}")
    try:
        meta_text = json.dumps(meta, indent=2, sort_keys=True)
    except TypeError as e:
        raise ValueError(f"save_model: meta is not JSON-serialisable: {e}") from e
    target.parent.mkdir(parents=True, exist_ok=True)
    staged = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        with _local_checkpointer() as ckptr:
            ckptr.save(staged / PARAMS_DIR, params)
            ckptr.wait_until_finished()
        (staged / CONFIG_FILE).write_text(json.dumps(model_cfg.model_dump(mode="json"), indent=2), encoding="utf-8")
        (staged / META_FILE).write_text(meta_text, encoding="utf-8")
        tokenizer.save(staged)
        if adapter is not None:
            save_adapter(adapter, staged)
        if not _present(staged, TOKENIZER_FILE):
            raise ValueError(f"save_model: tokenizer.save() wrote none of {', '.join(TOKENIZER_FILES)}")
        _swap_in(staged, target)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    return target


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{e.lineno}: invalid JSON: {e.msg}") from e


def load_model(model_dir: str | Path, *, max_len: int | None = None) -> LoadedModel:
    """Read an exported model, a Hugging Face model directory, an ``hf:`` hub id or a ``.gguf`` file.

    Params come back as jax arrays on the default device. ``max_len`` caps an imported model's
    context (default: its ``max_position_embeddings``); native models keep their own.
    """
    if is_gguf_file(model_dir) or str(model_dir).lower().endswith(".gguf"):  # llama.cpp's file: needle/model/gguf/
        return import_gguf_model(model_dir, max_len=max_len)
    if str(model_dir).startswith("hf:"):
        if is_needle3_source(_hub_snapshot(str(model_dir))):
            return import_needle3_model(model_dir, max_len=max_len)
        return import_hf_model(model_dir, max_len=max_len)
    if is_hf_model_dir(model_dir):
        return import_hf_model(model_dir, max_len=max_len)
    if is_needle3_source(model_dir):
        return import_needle3_model(model_dir, max_len=max_len)
    root = Path(model_dir).absolute()
    if not root.is_dir():
        raise ModelNotFoundError(f"{root}: no exported model directory here")
    missing = [name for name in REQUIRED if not _present(root, name)]
    if missing:
        raise ModelNotFoundError(
            f"{root}: incomplete exported model, missing {', '.join(missing)} "
            "(nor is it a Hugging Face model: no config.json with a model_type)"
        )
    try:
        cfg = ModelConfig.model_validate(_read_json(root / CONFIG_FILE))
    except ValueError as e:
        raise ValueError(f"{root / CONFIG_FILE}: invalid model config: {e}") from e
    meta = _read_json(root / META_FILE)
    # Pin every leaf to this process's default device: the saved sharding may name devices
    # (a GPU) that do not exist where the model is loaded.
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    target = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=device), abstract_params(cfg))
    try:
        with _local_checkpointer() as ckptr:
            params = ckptr.restore(root / PARAMS_DIR, target)
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointMismatchError(f"{root / PARAMS_DIR}: params do not match {CONFIG_FILE}: {e}") from e
    return LoadedModel(params=params, model_cfg=cfg, tokenizer=load_tokenizer(root), meta=meta)


def _hub_snapshot(spec: str) -> Path:
    # One snapshot with both layouts' files decides the family: Hugging Face or a Needle repository.
    return download_snapshot(spec, HF_PATTERNS + NEEDLE3_PATTERNS).path


def _present(root: Path, name: str) -> bool:
    # A Needle 3 model keeps its SentencePiece tokenizer.model where others keep tokenizer.json.
    if name == TOKENIZER_FILE:
        return any((root / f).is_file() for f in TOKENIZER_FILES)
    return (root / name).exists()


def gguf_model_dir(path: str | Path, cache_root: str | Path) -> Path:
    """``path`` imported once and saved as a needle model directory under ``cache_root``, keyed by the
    file's content (what ``needle serve FILE.gguf`` wraps; a second start reuses it)."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 24), b""):
            digest.update(chunk)
    target = Path(cache_root) / digest.hexdigest()[:16]
    if not (target / "config.json").is_file():  # save_model renames a complete directory into place
        loaded = import_gguf_model(path)
        save_model(target, loaded.params, loaded.model_cfg, loaded.tokenizer, loaded.meta)
    return target
