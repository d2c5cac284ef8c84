"""prepare_dataset: deterministic disjoint splits, columns, truncation policy, fingerprint, save/load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from data_helpers import good_row

from needle.config import DataConfig
from needle.data.prepare import PreparedData, collect_texts, prepare_dataset, split_indices
from needle.data.schema import parse_row
from needle.errors import DataError
from needle.tokenizers.native import Tokenizer, train_tokenizer


def _rows(n: int) -> list[dict]:
    return [good_row(query=f"Set a timer for {i} minutes", answers=[{"name": "set_timer", "arguments": {"minutes": i}}])
            for i in range(n)]  # fmt: skip


@pytest.fixture
def source(write_jsonl) -> Path:
    return write_jsonl(_rows(20))


def test_splits_are_deterministic_disjoint_and_complete() -> None:
    cfg = DataConfig(source="x", val_fraction=0.2, test_fraction=0.1, split_seed=3)
    a, b = split_indices(50, cfg), split_indices(50, cfg)
    assert a == b
    assert [len(a[k]) for k in ("train", "val", "test")] == [35, 10, 5]
    assert sorted(a["train"] + a["val"] + a["test"]) == list(range(50))
    assert split_indices(50, cfg.model_copy(update={"split_seed": 4}))["val"] != a["val"]


def test_split_sizes_at_the_edges() -> None:
    tiny = DataConfig(source="x", val_fraction=0.01, test_fraction=0.0)
    assert [len(v) for v in split_indices(3, tiny).values()] == [2, 1, 0]
    with pytest.raises(DataError, match="keep a train row"):
        split_indices(2, DataConfig(source="x", val_fraction=0.5, test_fraction=0.5))


def test_prepared_columns_and_stats(source: Path, data_tokenizer: Tokenizer) -> None:
    data = prepare_dataset(DataConfig(source=str(source), val_fraction=0.1, test_fraction=0.1), data_tokenizer)
    assert {k: len(v) for k, v in data.splits.items()} == {"train": 16, "val": 2, "test": 2}
    train = data.splits["train"]
    assert train.features["ids"].feature.dtype == "int32" and train.features["loss_mask"].feature.dtype == "int8"
    rec = train[0]
    assert rec["length"] == len(rec["ids"]) == len(rec["loss_mask"])
    row = parse_row({"query": rec["query"], "tools": json.loads(rec["tools"]), "answers": json.loads(rec["answers"])}, "s:1")
    assert rec["source"].startswith(f"{source}:") and row.answers[0]["name"] == "set_timer"
    assert data.stats["rows"] == {"train": 16, "val": 2, "test": 2} and data.stats["truncated"] == 0
    assert data.stats["tokens"]["train"]["total"] == sum(train["length"])
    assert set(data.stats["length"]) >= {"p50", "p90", "p99", "max"}
    sources = [s for ds in data.splits.values() for s in ds["source"]]
    assert len(set(sources)) == 20


def test_overlong_rows_are_refused_with_file_line_or_dropped_and_counted(write_jsonl, data_tokenizer: Tokenizer) -> None:
    long_row = good_row(query="Set a timer for " + "very " * 120 + "long minutes", answers=[{"name": "set_timer", "arguments": {"minutes": 5}}])
    path = write_jsonl(_rows(10) + [long_row] + _rows(2))
    cfg = DataConfig(source=str(path), max_len=200)
    # Default: refused, never cut, with its file:line and its real length.
    with pytest.raises(DataError, match=rf"{path}:11: row longer than max_len: \d+ tokens > max_len=200") as err:
        prepare_dataset(cfg, data_tokenizer)
    assert len(err.value.issues) == 1
    data = prepare_dataset(cfg.model_copy(update={"on_error": "drop"}), data_tokenizer)
    assert sum(data.stats["rows"].values()) == 12 and data.stats["too_long"] == 1 and data.stats["truncated"] == 0
    assert data.stats["dropped_reasons"] == {"row longer than max_len": 1}
    assert not any(t for ds in data.splits.values() for t in ds["truncated"])
    assert all(n <= 200 for ds in data.splits.values() for n in ds["length"])
    # Raising max_len keeps the row whole.
    whole = prepare_dataset(cfg.model_copy(update={"max_len": 1024}), data_tokenizer)
    assert sum(whole.stats["rows"].values()) == 13 and max(whole.stats["length"]["max"], 0) > 200


def test_bad_rows_fail_by_default_and_are_counted_when_dropped(write_jsonl, data_tokenizer: Tokenizer) -> None:
    path = write_jsonl(_rows(10) + ["not json", good_row(query=...)])
    with pytest.raises(DataError, match=":11: not valid JSON"):
        prepare_dataset(DataConfig(source=str(path)), data_tokenizer)
    data = prepare_dataset(DataConfig(source=str(path), on_error="drop"), data_tokenizer)
    assert data.stats["dropped"] == 2 and sum(data.stats["rows"].values()) == 10
    assert data.stats["dropped_reasons"] == {"not valid JSON": 1, "missing field": 1}


def test_fingerprint_tracks_bytes_seed_and_tokenizer_only(write_jsonl, tmp_path, data_tokenizer: Tokenizer) -> None:
    src = write_jsonl(_rows(12), name="a.jsonl")
    cfg = DataConfig(source=str(src))
    base = prepare_dataset(cfg, data_tokenizer).fingerprint
    # Same bytes elsewhere, a re-run, and a policy that changes nothing: same fingerprint.
    copy = tmp_path / "copy" / "b.jsonl"
    copy.parent.mkdir()
    copy.write_bytes(src.read_bytes())
    assert prepare_dataset(cfg.model_copy(update={"source": str(copy)}), data_tokenizer).fingerprint == base
    assert prepare_dataset(cfg.model_copy(update={"on_error": "drop"}), data_tokenizer).fingerprint == base
    # One changed byte, another seed, fraction or max_len, another tokenizer: all differ.
    edited = write_jsonl(_rows(11) + [good_row(query="Set a timer for 11 minutez")], name="c.jsonl")
    other_tok = train_tokenizer(collect_texts([parse_row(r, "s:1") for r in _rows(12)]), vocab_size=300)
    changed = {
        prepare_dataset(cfg.model_copy(update={"source": str(edited)}), data_tokenizer).fingerprint,
        prepare_dataset(cfg.model_copy(update={"split_seed": 1}), data_tokenizer).fingerprint,
        prepare_dataset(cfg.model_copy(update={"val_fraction": 0.2}), data_tokenizer).fingerprint,
        prepare_dataset(cfg.model_copy(update={"max_len": 200}), data_tokenizer).fingerprint,
        prepare_dataset(cfg, other_tok).fingerprint,
    }
    assert len(changed) == 5 and base not in changed


def test_save_and_load_round_trip(source: Path, tmp_path: Path, data_tokenizer: Tokenizer) -> None:
    data = prepare_dataset(DataConfig(source=str(source)), data_tokenizer)
    data.save(tmp_path / "prep")
    assert not list((tmp_path / "prep").rglob("*.pkl"))
    back = PreparedData.load(tmp_path / "prep")
    assert back.fingerprint == data.fingerprint and back.stats == data.stats
    for name, ds in data.splits.items():
        assert back.splits[name]["ids"] == ds["ids"] and back.splits[name]["source"] == ds["source"]


def test_a_zero_fraction_gives_an_empty_split_with_the_columns(source: Path, tmp_path: Path, data_tokenizer: Tokenizer) -> None:
    data = prepare_dataset(DataConfig(source=str(source), test_fraction=0.0), data_tokenizer)
    assert len(data.splits["test"]) == 0
    assert data.splits["test"].column_names == data.splits["train"].column_names
    data.save(tmp_path / "p")
    assert len(PreparedData.load(tmp_path / "p").splits["test"]) == 0
