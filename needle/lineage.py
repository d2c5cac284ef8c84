"""What a model was made from, as content fingerprints: the run's inputs key decides "unchanged".

A retrain compares its inputs with the champion's before it loads a row or starts JAX:

    data = data_digest("landing/")                       # content of the files, not names/mtimes
    base = base_fingerprint("auto", auto)                 # auto: its data digest + configs
    key  = inputs_key(data, base, config)                 # what a model version carries as train_key

Everything here is pure (files and hashes): no Prefect, no MLflow.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

from needle.data.load import file_digest, load_source, source_digest
from needle.pipeline import auto_base_key, config_digest


def data_digest(source: str, on_error: str = "fail") -> str:
    """The content digest of a data source: raw bytes for local files (no parsing: fast), the
    loaded rows for a hub id. Equal to ``load_source(source).digest``."""
    digest = source_digest(source)
    return digest if digest is not None else load_source(source, on_error).digest  # type: ignore[arg-type]


def directory_digest(path: str | Path) -> str:
    """sha256 over every file of a directory: its path inside the directory and its content."""
    root = Path(path)
    hasher = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            full = Path(dirpath) / name
            hasher.update(str(full.relative_to(root)).encode() + b"\0" + file_digest(str(full)).encode() + b"\n")
    return hasher.hexdigest()


def base_fingerprint(spec: str, auto: Any | None = None) -> dict[str, str]:
    """Where the base comes from and a key that changes when it does.

    ``auto``: the digest of its rows and configs (the cache folder it is trained into); a local
    model directory: the content of its files; a single file (a ``.gguf`` model, a Needle 3
    checkpoint): its content; ``hf:owner/name@revision``: the id itself (pin a
    revision: without one the hub's head may move under the same key).
    """
    if spec == "auto":
        return {"base_source": f"auto:{auto.data.source}", "base_key": auto_base_key(auto, data_digest(auto.data.source, auto.data.on_error))}
    if Path(spec).is_dir():
        return {"base_source": str(spec), "base_key": directory_digest(spec)}
    if Path(spec).is_file():  # a file replaced under the same name must not reuse the old model
        return {"base_source": str(spec), "base_key": file_digest(spec)}
    return {"base_source": spec, "base_key": hashlib.sha256(spec.encode()).hexdigest()[:16]}


def inputs_key(data: str, base_key: str, config: dict[str, Any]) -> str:
    """One key for (data, base, training config): equal keys train the same model."""
    return config_digest(data, base_key, config)
