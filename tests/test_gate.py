"""The gate rule, the shipped gate set (held out from every training row, reproducible), and
content fingerprints of folders and globs (names and mtimes play no part)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from needle.gate import (DEFAULT_GATE, GATE_ROWS, GateRule, decide, decision_table, gate_fingerprint,
                         user_queries)
from needle.gate import write_gate_sample

ROOT = Path(__file__).resolve().parents[1]


def test_no_champion_promotes() -> None:
    verdict = decide({"exact_match": 0.1}, None, GateRule())
    assert verdict.promote and verdict.label == "promoted: no champion yet"


def test_primary_metric_with_margin() -> None:
    rule = GateRule(margin=0.02, guarded={})
    assert decide({"exact_match": 0.72}, {"exact_match": 0.70}, rule).promote
    lost = decide({"exact_match": 0.71}, {"exact_match": 0.70}, rule)
    assert not lost.promote and "exact_match 0.7100 < 0.7200" in lost.reason
    assert decide({"exact_match": 0.70}, {"exact_match": 0.70}, GateRule(guarded={})).promote  # ties: margin 0


def test_guarded_metric_beyond_tolerance_blocks_promotion() -> None:
    rule = GateRule(guarded={"valid_call_rate": 0.02, "offtopic_accuracy": 0.05})
    champ = {"exact_match": 0.5, "valid_call_rate": 0.90, "offtopic_accuracy": None}
    assert decide({"exact_match": 0.6, "valid_call_rate": 0.885}, champ, rule).promote  # within 0.02; no off-topic rows
    worse = decide({"exact_match": 0.6, "valid_call_rate": 0.87}, champ, rule)
    assert not worse.promote and "valid_call_rate" in worse.reason and "guarded" in worse.reason
    missing = decide({"valid_call_rate": 0.95}, {"exact_match": 0.5, "valid_call_rate": 0.9}, rule)
    assert not missing.promote  # a challenger without the primary metric never wins


def test_rule_is_strict_and_table_lists_both_sides() -> None:
    with pytest.raises(ValueError):
        GateRule(margn=0.1)  # type: ignore[call-arg]
    verdict = decide({"exact_match": 0.4, "valid_call_rate": 0.9}, {"exact_match": 0.5, "valid_call_rate": 0.9},
                     GateRule())
    rows = {r["metric"]: r for r in decision_table({"exact_match": 0.4}, {"exact_match": 0.5}, verdict)}
    assert rows["exact_match"]["ok"] == "NO" and rows["exact_match"]["delta"] == "-0.1000"
    assert rows["arg_f1"]["rule"] == "reported"


def test_gate_fingerprint_covers_rows_and_decoding() -> None:
    a = gate_fingerprint("d1", {"max_new_tokens": 96, "max_rows": None})
    assert a == gate_fingerprint("d1", {"max_rows": None, "max_new_tokens": 96})
    assert a != gate_fingerprint("d2", {"max_new_tokens": 96, "max_rows": None})
    assert a != gate_fingerprint("d1", {"max_new_tokens": 64, "max_rows": None})


def test_shipped_gate_set_is_held_out(tmp_path: Path) -> None:
    """No row of the fixed gate set is in the bundled fine-tuning rows (so in no split of them)."""
    gate = ROOT / DEFAULT_GATE
    new = ROOT / "data" / "sample" / "new.jsonl"
    gate_rows = [json.loads(line) for line in gate.read_text().splitlines()]
    train_queries = {q for line in new.read_text().splitlines() for q in user_queries(json.loads(line))}
    assert any("messages" in json.loads(line) for line in new.read_text().splitlines())  # conversations count too
    assert len(gate_rows) == GATE_ROWS == len({r["query"] for r in gate_rows})
    assert not {r["query"] for r in gate_rows} & train_queries  # no training split holds a gate row
    from needle.data.load import validate_source

    assert validate_source(str(gate)).ok
    assert write_gate_sample(tmp_path / "all.jsonl", new).read_text() == gate.read_text()  # python -m needle.gate
    drawn = [json.loads(line) for line in write_gate_sample(tmp_path / "g.jsonl", new, n=20).read_text().splitlines()]
    assert len(drawn) == 20 and not {r["query"] for r in drawn} & train_queries


def test_folder_and_glob_digest_is_by_content(tmp_path: Path) -> None:
    from needle.data.load import load_source, source_digest

    landing = tmp_path / "landing"
    landing.mkdir()
    new = ROOT / "data" / "sample" / "gate.jsonl"
    lines = new.read_text().splitlines(keepends=True)
    (landing / "a.jsonl").write_text("".join(lines[:5]))
    (landing / "b.jsonl").write_text("".join(lines[5:9]))
    first = source_digest(str(landing))
    assert first == load_source(str(landing)).digest == source_digest(str(landing / "*.jsonl"))
    os.utime(landing / "a.jsonl", (1, 1))
    shutil.move(landing / "b.jsonl", landing / "zz-renamed.jsonl")
    assert source_digest(str(landing)) == first  # mtimes and names play no part
    (landing / "c.jsonl").write_text(lines[9])
    assert source_digest(str(landing)) != first  # new content does
    single = source_digest(str(new))
    assert single == load_source(str(new)).digest


def test_overlap_counts_gate_rows_seen_in_training() -> None:
    from needle.data.load import load_source
    from needle.gate import overlap_count

    gate = load_source(str(ROOT / DEFAULT_GATE)).rows
    assert overlap_count(load_source(str(ROOT / "data" / "sample" / "new.jsonl")).rows, gate) == 0
    assert overlap_count(gate[:7], gate) == 7
    leaked = {"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"},
                           {"role": "user", "content": gate[3].query}, {"role": "assistant", "content": "ok"}]}
    assert user_queries(leaked) == ["hello", gate[3].query]
    assert overlap_count([leaked], gate) == 1  # a gate query in a later turn of a conversation leaks too
