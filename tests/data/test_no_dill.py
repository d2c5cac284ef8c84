"""Loading and preparing data never asks ``datasets`` to hash (dill-pickle) a table.

``Dataset.from_list`` names a new dataset by dill-pickling its arrow table; where pyarrow lies
outside site-packages (``pip install --target`` on PYTHONPATH, as on the TPU image) that fails
with ``PicklingError: Can't pickle <class 'MonthDayNano'>`` before training starts. Here every
use of datasets' hashing raises, and the bundled samples still load and prepare, to the same
tables ``from_list`` builds.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import datasets
import datasets.fingerprint
import datasets.utils._dill
import pytest

from needle.config import DataConfig
from needle.data import load
from needle.data.load import ROW_FEATURES, load_source, row_to_record
from needle.data.prepare import FEATURES, PreparedData, compute_fingerprint, prepare_rows
from needle.tokenizers.native import Tokenizer

SAMPLE = Path(__file__).resolve().parents[2] / "data" / "sample"
HEAD = 150  # rows taken from the big samples (base: 12,000, new: 4,600): loading them whole takes seconds


def _refuse_hashing(monkeypatch: pytest.MonkeyPatch, allow: Any = lambda value: False) -> None:
    """Every datasets hash / dill pickle raises, as on the TPU image (unless ``allow(value)``)."""

    def refuse(value: Any, *args: Any, **kwargs: Any) -> Any:
        raise pickle.PicklingError(f"datasets hashing refused in this test: {type(value).__name__}")

    real_hash = datasets.fingerprint.Hasher.hash.__func__

    def hash_(cls: type, value: Any) -> str:
        if allow(value):
            return real_hash(cls, value)
        refuse(value)

    monkeypatch.setattr(datasets.fingerprint.Hasher, "hash", classmethod(hash_))
    for module, name in ((datasets.utils._dill, "dump"), (datasets.utils._dill, "dumps"), (datasets.fingerprint, "dumps")):
        real = getattr(module, name)
        guarded = lambda value, *a, _real=real, **k: _real(value, *a, **k) if allow(value) else refuse(value)  # noqa: E731
        monkeypatch.setattr(module, name, guarded)


def _sample_sources(tmp_path: Path) -> list[Path]:
    """Every bundled sample: the small ones whole, the first ``HEAD`` lines of the big ones."""
    out = []
    for path in sorted(SAMPLE.glob("*.jsonl")):
        lines = path.read_bytes().splitlines(keepends=True)
        if len(lines) > HEAD:
            path = tmp_path / path.name
            path.write_bytes(b"".join(lines[:HEAD]))
        out.append(path)
    assert {p.name for p in out} >= {"base.jsonl", "new.jsonl", "gate.jsonl", "conversations.jsonl"}
    return out


def test_hashing_is_refused_by_the_patch(monkeypatch: pytest.MonkeyPatch) -> None:
    _refuse_hashing(monkeypatch)
    with pytest.raises(pickle.PicklingError):
        datasets.Dataset.from_list([{"query": "q"}])


def test_samples_load_and_prepare_without_datasets_hashing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          data_tokenizer: Tokenizer) -> None:  # fmt: skip
    sources = _sample_sources(tmp_path)
    cfg = DataConfig(source="x", max_len=4096, val_fraction=0.1, test_fraction=0.1)
    with monkeypatch.context() as m:
        _refuse_hashing(m)
        loaded = [load_source(str(p)) for p in sources]
        prepared = [prepare_rows(src, cfg, data_tokenizer) for src in loaded]
        again = prepare_rows(loaded[0], cfg, data_tokenizer)
    # Outputs as before: the rows, needle's fingerprint, and the very tables from_list builds.
    for src, prep in zip(loaded, prepared):
        assert src.rows and src.digest
        assert prep.fingerprint == compute_fingerprint(src.digest, data_tokenizer, cfg)
        assert sum(len(ds) for ds in prep.splits.values()) == len(src.rows)
        for ds in prep.splits.values():
            reference = datasets.Dataset.from_list(ds.to_list(), features=FEATURES)
            assert ds.features == reference.features
            assert ds.data.table.equals(reference.data.table, check_metadata=True)
    rows = loaded[0].rows
    records = [row_to_record(r) for r in rows]
    assert load.records_dataset(records, ROW_FEATURES).data.table.equals(
        datasets.Dataset.from_list(records, features=ROW_FEATURES).data.table, check_metadata=True)
    # The datasets fingerprint is a content hash: the same data gives the same one, other data another.
    assert [ds._fingerprint for ds in again.splits.values()] == [ds._fingerprint for ds in prepared[0].splits.values()]
    fingerprints = {ds._fingerprint for prep in prepared for ds in prep.splits.values()}
    assert len(fingerprints) == 3 * len(prepared)


def _plain(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(_plain(k) and _plain(v) for k, v in value.items())
    return value is None or isinstance(value, (str, bytes, int, float, range))


def test_prepared_data_saves_and_loads_without_hashing_a_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               data_tokenizer: Tokenizer) -> None:  # fmt: skip
    # save_to_disk/load_from_disk hash their own transform names and arguments (strings, ranges)
    # with no way to pass a fingerprint; those pickle anywhere. No table or function is hashed.
    cfg = DataConfig(source="x", max_len=4096, test_fraction=0.0)
    with monkeypatch.context() as m:
        _refuse_hashing(m, allow=_plain)
        data = prepare_rows(load_source(str(SAMPLE / "gate.jsonl")), cfg, data_tokenizer)
        data.save(tmp_path / "prep")
        back = PreparedData.load(tmp_path / "prep")
    assert back.fingerprint == data.fingerprint and len(back.splits["test"]) == 0
    for name, ds in data.splits.items():
        assert back.splits[name].data.table.equals(ds.data.table)
    assert (tmp_path / "prep" / "train" / "state.json").read_text().count(data.splits["train"]._fingerprint) == 1
