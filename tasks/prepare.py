"""Prefect task: validate, tokenize, split and fingerprint a dataset; save it; return the path.

The task is cached on the input files' bytes, the data config and the tokenizer, so an
unchanged dataset is prepared once; the saved directory is also keyed by the same hash, so
the task is idempotent even when Prefect's cache record is gone.
"""

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Optional

from prefect import task
from prefect.context import TaskRunContext

from needle.config import DataConfig

TOKENIZER_SUBDIR = "tokenizer"
_DONE = "prepared.ok"


def hash_source(source: str) -> str:
    """sha256 of a local source's bytes (files in order); a hub id hashes as its name."""
    from needle.data.load import resolve_files

    files = resolve_files(source)
    h = hashlib.sha256()
    for path in files or [source]:
        h.update(path.encode())
        if files is not None:
            with open(path, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
    return h.hexdigest()


def prepare_key(data_cfg: DataConfig, tokenizer_from: Optional[str], vocab_size: int) -> str:
    """The cache key: input bytes, prep config and tokenizer (or the vocab it will be trained to)."""
    tok = "train:%d" % vocab_size
    if tokenizer_from:
        tok_file = Path(tokenizer_from) / "tokenizer.json"
        tok = hashlib.sha256(tok_file.read_bytes()).hexdigest() if tok_file.exists() else tokenizer_from
    parts = {"data": hash_source(data_cfg.source), "cfg": data_cfg.model_dump(mode="json"), "tok": tok}
    # The source path itself is not part of the key: moving a file must not re-prepare it.
    parts["cfg"].pop("source")
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def _cache_key(context: TaskRunContext, parameters: dict[str, Any]) -> Optional[str]:
    try:
        key = prepare_key(parameters["data_cfg"], parameters.get("tokenizer_from"), parameters.get("vocab_size", 0))
    except Exception:  # a missing file: no cache, the task itself reports the error
        return None
    # Only a cached path that still exists is worth returning; otherwise run (and re-save).
    return f"prepare-{key}" if (Path(parameters["out_root"]) / key / _DONE).exists() else None


# log_prints off: datasets fingerprints functions with dill, which captures dis.dis output from
# stdout; the flow's log_prints would turn those bytecode listings into log lines.
@task(name="prepare", cache_key_fn=_cache_key, result_serializer="json", persist_result=True, log_prints=False)
def prepare(data_cfg: DataConfig, out_root: str, tokenizer_from: Optional[str] = None, vocab_size: int = 0) -> str:
    """Validate, tokenize (base model's tokenizer, or a new one), split and save; return the dir."""
    from needle.data.prepare import PreparedData, prepare_dataset
    from needle.recipe import build_tokenizer
    from needle.tokenizer import Tokenizer

    out = Path(out_root) / prepare_key(data_cfg, tokenizer_from, vocab_size)
    if (out / _DONE).exists():
        PreparedData.load(out)  # proves the saved splits are readable before reuse
        return str(out)
    if tokenizer_from:
        tokenizer = Tokenizer.load(tokenizer_from)
    else:
        tokenizer = build_tokenizer(data_cfg.source, vocab_size, on_error=data_cfg.on_error)
    prepared = prepare_dataset(data_cfg, tokenizer)
    tmp = out.with_name(out.name + ".tmp-%d" % os.getpid())
    prepared.save(tmp)
    tokenizer.save(tmp / TOKENIZER_SUBDIR)
    (tmp / _DONE).write_text(prepared.fingerprint)
    if out.exists():  # a half-written earlier attempt
        import shutil

        shutil.rmtree(out)
    tmp.rename(out)
    return str(out)
