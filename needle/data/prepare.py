"""Rows -> tokenized train/val/test HF datasets, with a fingerprint and statistics.

The split is a seeded permutation (``DataConfig.split_seed``), so the same input and config
always give the same splits. The fingerprint hashes everything that decides the prepared
tensors: raw input bytes, template, tokenizer, split seed and fractions, ``max_len``.
A row longer than ``max_len`` tokens is never cut (a cut row would train on a cut answer): it
is refused with its file:line and length (``on_error="fail"``, the default), or dropped and
counted under its reason (``on_error="drop"``). Raise ``max_len`` (up to the model's context)
to keep such rows.

    data = prepare_dataset(DataConfig(source="data/sample/base.jsonl"), tokenizer)
    data.save("out/prepared"); data = PreparedData.load("out/prepared")

``prepare_rows`` does the same for rows already read and validated (``load_source``), so a
caller that validated a source first does not read it again; ``save_cached``/``load_cached``
keep a prepared dataset with its tokenizer under a content key (``cache_key``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import numpy as np

from needle.config import DataConfig
from needle.data.chat import ChatTemplateError, format_for
from needle.data.load import LoadedSource, load_source, records_dataset, row_to_record
from needle.data.render import TEMPLATE, TEMPLATE_VERSION, ChatFormat, Example, NativeFormat, render_text
from needle.data.schema import Row, split_source
from needle.errors import DataError, DataIssue
from needle.tokenizers.load import load_tokenizer
from needle.tokenizers.native import Tokenizer

log = logging.getLogger(__name__)
SPLITS = ("train", "val", "test")
META_FILE = "meta.json"
TOKENIZER_SUBDIR = "tokenizer"
_DONE = "prepared.ok"
_NO_LIMIT = 1 << 30  # encode without cutting; over-long rows are refused or dropped, not truncated
FEATURES = datasets.Features(
    {
        "ids": datasets.List(datasets.Value("int32")),
        "loss_mask": datasets.List(datasets.Value("int8")),
        "length": datasets.Value("int32"),
        "truncated": datasets.Value("bool"),
        "query": datasets.Value("string"),
        "tools": datasets.Value("string"),
        "answers": datasets.Value("string"),
        "reasoning": datasets.Value("string"),
        "system": datasets.Value("string"),
        "source": datasets.Value("string"),
        "messages": datasets.Value("string"),  # a conversation row's messages (JSON); null for query/answers
    }
)


@dataclass
class PreparedData:
    """Tokenized splits plus the fingerprint that names them and statistics for reports."""

    splits: dict[str, datasets.Dataset]
    fingerprint: str
    stats: dict[str, Any]

    def save(self, directory: str | Path) -> Path:
        """Write each split with ``save_to_disk`` and ``meta.json``; returns the directory."""
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        # datasets cannot load back an empty saved split: record empty ones in meta.json instead.
        empty = [name for name, ds in self.splits.items() if len(ds) == 0]
        for name, ds in self.splits.items():
            if name not in empty:
                ds.save_to_disk(str(path / name))
        meta = {"fingerprint": self.fingerprint, "stats": self.stats, "splits": list(self.splits), "empty": empty}
        (path / META_FILE).write_text(json.dumps(meta, indent=2), encoding="utf-8")
        return path

    @classmethod
    def load(cls, directory: str | Path) -> "PreparedData":
        path = Path(directory)
        meta = json.loads((path / META_FILE).read_text(encoding="utf-8"))
        empty = set(meta.get("empty", []))
        splits = {name: _empty_split() if name in empty else datasets.load_from_disk(str(path / name))
                  for name in meta["splits"]}
        return cls(splits=splits, fingerprint=meta["fingerprint"], stats=meta["stats"])


def _empty_split() -> datasets.Dataset:
    """A split with no rows but all the columns (``from_list([])`` would lose them)."""
    return records_dataset([], FEATURES)


def collect_texts(rows: list[Row]) -> list[str]:
    """Full rendered texts (prompt + target) of ``rows``, to train a tokenizer on."""
    return [render_text(r) for r in rows]


def split_indices(n: int, cfg: DataConfig) -> dict[str, list[int]]:
    """Deterministic, disjoint train/val/test row indices (each sorted) for ``n`` rows.

    A split with a non-zero fraction gets at least one row; train must keep at least one.
    """
    sizes = {}
    for name, frac in (("val", cfg.val_fraction), ("test", cfg.test_fraction)):
        sizes[name] = max(1, round(n * frac)) if frac > 0 else 0
    n_train = n - sizes["val"] - sizes["test"]
    if n_train < 1:
        reason = f"{n} row(s) cannot fill val={sizes['val']} and test={sizes['test']} and keep a train row"
        raise DataError([DataIssue(cfg.source, 0, reason)])
    perm = np.random.default_rng(cfg.split_seed).permutation(n)
    cuts = {"val": perm[: sizes["val"]], "test": perm[sizes["val"] : sizes["val"] + sizes["test"]]}
    cuts["train"] = perm[sizes["val"] + sizes["test"] :]
    return {name: sorted(int(i) for i in cuts[name]) for name in SPLITS}


def tokenizer_sha256(tokenizer: Tokenizer) -> str:
    """The content hash of a tokenizer (its JSON form): what the fingerprint and cache keys use."""
    return hashlib.sha256(tokenizer.to_json().encode("utf-8")).hexdigest()


def compute_fingerprint(digest: str, tokenizer: Tokenizer, cfg: DataConfig, fmt: ChatFormat | None = None) -> str:
    """sha256 over the input bytes' digest, template, tokenizer, split config and max_len."""
    h = hashlib.sha256()
    # Needle's own template keeps the parts it has always hashed (existing caches stay valid);
    # a model's chat template is hashed by its full text.
    native = fmt is None or isinstance(fmt, NativeFormat)
    parts = {
        "input_sha256": digest,
        "template_version": TEMPLATE_VERSION if native else "chat",
        "template": TEMPLATE if native else fmt.template_id(),
        "split_seed": cfg.split_seed,
        "val_fraction": cfg.val_fraction,
        "test_fraction": cfg.test_fraction,
        "max_len": cfg.max_len,
    }
    if cfg.loss_on != "all_assistant":  # only then: fingerprints from before the option keep their value
        parts["loss_on"] = cfg.loss_on
    h.update(json.dumps(parts, sort_keys=True).encode("utf-8"))
    h.update(bytes.fromhex(tokenizer_sha256(tokenizer)))
    return h.hexdigest()


def _record(row: Row, ex: Example) -> dict[str, Any]:
    meta = {"ids": ex.ids, "loss_mask": ex.loss_mask, "length": len(ex.ids), "truncated": ex.truncated}
    return {**meta, **row_to_record(row)}


def _length_stats(lengths: list[int]) -> dict[str, float]:
    if not lengths:
        return {}
    arr = np.asarray(lengths)
    pct = {f"p{q}": float(np.percentile(arr, q)) for q in (50, 90, 99)}
    return {**pct, "min": int(arr.min()), "max": int(arr.max()), "mean": float(arr.mean())}


def _issue_kind(reason: str) -> str:
    # Group reasons like "answers[0] (set_timer) is missing required argument 'x'" by their
    # wording, not their specifics, so the stats show a handful of kinds.
    return reason.split(":")[0].split("(")[0].split("'")[0].strip()


def prepare_dataset(cfg: DataConfig, tokenizer: Tokenizer) -> PreparedData:
    """Load ``cfg.source``, split it, tokenize it and build the three ``datasets.Dataset``."""
    return prepare_rows(load_source(cfg.source, cfg.on_error), cfg, tokenizer)


def overlong_reason(n_tokens: int, max_len: int) -> str:
    """The file:line reason of a row over ``max_len`` (its kind, before the colon, is what drop counts)."""
    return (f"row longer than max_len: {n_tokens} tokens > max_len={max_len} (raise max_len, up to the "
            "model's context, or drop such rows with on_error=drop)")  # fmt: skip


CONVERSATION_NOT_RENDERED = ("conversation rows cannot be trained on with this model's format: it has no "
                             "encode_conversation (needle's, Needle 3's and Jinja chat templates have); "
                             "give query/answers rows")


def _encode_rows(loaded: LoadedSource, cfg: DataConfig, tokenizer: Tokenizer, fmt: ChatFormat) -> tuple[list[Row], list[Example], list[DataIssue]]:
    """Render and tokenize every row; a row the chat template refuses, or one longer than
    ``max_len`` tokens, is a file:line issue (raised under ``on_error="fail"``, else dropped)."""
    rows, examples, refused = [], [], []
    for row in loaded.rows:
        if row.messages is not None and not hasattr(fmt, "encode_conversation"):
            # A format that cannot render whole conversations (a custom ChatFormat): encoding one
            # as its last query/answers would train on another example, so refuse it.
            refused.append(DataIssue(*split_source(row.source), CONVERSATION_NOT_RENDERED))
            continue
        try:
            # Encoded whole (no cut) so an over-long row is refused with its real length.
            if row.messages is not None:
                ex = fmt.encode_conversation(row, tokenizer, _NO_LIMIT, cfg.loss_on)
            else:  # today's path, unchanged (a query/answers row encodes to the same ids either way: tested)
                ex = fmt.encode_example(row, tokenizer, _NO_LIMIT)
        except (ChatTemplateError, ValueError) as e:
            if not isinstance(e, ChatTemplateError) and row.messages is None:
                raise  # a query/answers row's ValueError propagates as it always has
            refused.append(DataIssue(*split_source(row.source), f"chat template refused the row: {e}"))
            continue
        if len(ex.ids) > cfg.max_len:
            refused.append(DataIssue(*split_source(row.source), overlong_reason(len(ex.ids), cfg.max_len)))
            continue
        rows.append(row)
        examples.append(ex)
    if refused and cfg.on_error == "fail":
        raise DataError(refused)
    return rows, examples, refused


def prepare_rows(loaded: LoadedSource, cfg: DataConfig, tokenizer: Tokenizer) -> PreparedData:
    """Split, tokenize and build the three ``datasets.Dataset`` of rows read by ``load_source``.

    Rows are rendered with the tokenizer's chat format: a pretrained model's own template, or
    needle's (``needle.data.chat.format_for``).
    """
    fmt = format_for(tokenizer)
    rows, examples, refused = _encode_rows(loaded, cfg, tokenizer, fmt)
    issues = [*loaded.issues, *refused]
    parts = split_indices(len(rows), cfg)
    splits: dict[str, datasets.Dataset] = {}
    tokens: dict[str, dict[str, int]] = {}
    for name, idx in parts.items():
        records = [_record(rows[i], examples[i]) for i in idx]
        # Built without datasets' dill fingerprinting (see records_dataset); same table as from_list.
        splits[name] = records_dataset(records, FEATURES) if records else _empty_split()
        tokens[name] = {
            "total": sum(len(examples[i].ids) for i in idx),
            "target": sum(sum(examples[i].loss_mask) for i in idx),
        }
    stats = {
        "n_files": len(loaded.files),
        "rows_read": len(rows) + len(issues),
        "rows": {name: len(idx) for name, idx in parts.items()},
        "dropped": len(issues),
        "dropped_reasons": dict(Counter(_issue_kind(i.reason) for i in issues)),
        "dropped_examples": [str(i) for i in issues[:20]],
        "too_long": sum(i.reason.startswith("row longer than max_len") for i in refused),
        "truncated": 0,  # over-long rows are refused or dropped, never cut
        "tokens": tokens,
        "length": _length_stats([len(ex.ids) for ex in examples]),
        "max_len": cfg.max_len,
    }
    return PreparedData(splits, compute_fingerprint(loaded.digest, tokenizer, cfg, fmt), stats)


def cache_key(digest: str, cfg: DataConfig, tokenizer_id: str) -> str:
    """The key of a prepared dataset: input bytes' digest, prep config and tokenizer identity.

    The source path itself is not part of it: moving a file must not re-prepare it.
    """
    parts = {"data": digest, "cfg": cfg.model_dump(mode="json", exclude={"source"}), "tok": tokenizer_id}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def save_cached(prepared: PreparedData, tokenizer: Tokenizer, directory: str | Path) -> Path:
    """Write the splits and tokenizer to a temp sibling, then rename: never half-written."""
    out = Path(directory)
    tmp = out.with_name(out.name + ".tmp-%d" % os.getpid())
    prepared.save(tmp)
    tokenizer.save(tmp / TOKENIZER_SUBDIR)
    (tmp / _DONE).write_text(prepared.fingerprint)
    if out.exists():  # a half-written earlier attempt
        shutil.rmtree(out)
    tmp.rename(out)
    return out


def load_cached(directory: str | Path) -> tuple[PreparedData, Tokenizer] | None:
    """The prepared dataset and tokenizer saved by :func:`save_cached`, or None if incomplete."""
    path = Path(directory)
    if not (path / _DONE).exists():
        return None
    return PreparedData.load(path), load_tokenizer(path / TOKENIZER_SUBDIR)
