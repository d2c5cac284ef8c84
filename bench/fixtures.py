"""What every benchmark section starts from: the JSONL, a tokenizer, prepared splits, a base.

Everything is built once under ``.cache/bench`` (git-ignored) and reused, so sections that run
in separate subprocesses share the same inputs; the base model is random-init (the benchmark
measures speed, not quality), saved with ``needle.model.io.save_model`` like a real base.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from needle.config import DataConfig, model_preset
from needle.data.sample import write_sample
from needle.tokenizers.native import Tokenizer, train_tokenizer

REPO = Path(__file__).resolve().parent.parent
CACHE = REPO / ".cache" / "bench"
SAMPLE = REPO / "data" / "sample" / "new.jsonl"


def ensure_jsonl(n_rows: int | None = None) -> Path:
    """``data/sample/new.jsonl`` (generated under .cache/bench when absent), or its first rows."""
    source = SAMPLE
    if not source.exists():
        source = CACHE / "data" / "new.jsonl"
        if not source.exists():
            write_sample(source.parent, seed=0)
    if n_rows is None:
        return source
    lines = source.read_text(encoding="utf-8").splitlines(keepends=True)
    if n_rows > len(lines):
        raise ValueError(f"{source} has {len(lines)} rows, fewer than the {n_rows} asked for")
    head = CACHE / "data" / f"{source.stem}.first{n_rows}.jsonl"
    if not head.exists() or head.stat().st_mtime < source.stat().st_mtime:
        head.parent.mkdir(parents=True, exist_ok=True)
        head.write_text("".join(lines[:n_rows]), encoding="utf-8")
    return head


def load_tokenizer(jsonl: Path, vocab_size: int) -> Any:
    """A byte-level BPE trained on the rows (cached per source file and vocabulary size)."""
    # lazy: bench.run's parent imports this module; only the sections that prepare data load datasets
    from needle.data.load import read_rows
    from needle.data.prepare import collect_texts

    tok_dir = CACHE / f"tokenizer-{jsonl.stem}-{vocab_size}"
    if (tok_dir / "tokenizer.json").exists():
        return Tokenizer.load(tok_dir)
    tok = train_tokenizer(collect_texts(read_rows(str(jsonl))[0]), vocab_size=vocab_size)
    tok.save(tok_dir)
    return tok


def prepare(jsonl: Path, tok: Any, max_len: int = 256, val_fraction: float = 0.1, test_fraction: float = 0.1) -> Any:
    """Prepared splits of ``jsonl`` (not cached: preparing is itself one of the measurements)."""
    # lazy, as in load_tokenizer
    from needle.data.prepare import prepare_dataset

    # Over-long rows are dropped (and counted in the stats), as a user would run these data.
    cfg = DataConfig(source=str(jsonl), max_len=max_len, val_fraction=val_fraction, test_fraction=test_fraction,
                     on_error="drop")
    return prepare_dataset(cfg, tok)


def ensure_base(preset: str, tok: Any) -> Path:
    """A random-init base model of ``preset`` exported like a trained one (for lora/full runs)."""
    # lazy: bench.run imports this module before its main() sets JAX_PLATFORMS
    import jax
    from needle.model import lora as lora_lib
    from needle.model.io import save_model

    model_cfg = model_preset(preset)
    out = CACHE / f"base-{preset}-{tok.vocab_size}"
    saved = out / "config.json"
    # Presets change while the project evolves: reuse the cached base only if it still matches.
    if saved.exists() and json.loads(saved.read_text()) == model_cfg.model_dump(mode="json"):
        return out
    params = jax.device_get(lora_lib.init_params(model_cfg, None, 0))
    save_model(out, params, model_cfg, tok, {"mode": "random-init", "purpose": "benchmark base"})
    return out


def cache_dir(name: str) -> Path:
    """A scratch directory under .cache/bench (created)."""
    path = CACHE / name
    os.makedirs(path, exist_ok=True)
    return path
