"""The synthetic generator: bundled files reproduce exactly, rows are valid, varied and copyable."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from needle.data.load import validate_source
from needle.data.sample import generate_rows, write_sample
from needle.data.sample_tools import BASE_TOOLS, CATALOGUE, NEW_TOOLS

BUNDLED = Path(__file__).resolve().parents[2] / "data" / "sample"


def test_bundled_sample_regenerates_byte_identical_and_validates(tmp_path: Path) -> None:
    paths = write_sample(tmp_path)
    for part in ("base", "new"):
        assert paths[part].read_bytes() == (BUNDLED / f"{part}.jsonl").read_bytes(), part
    for part, n in (("base", 12000), ("new", 4600)):  # new: 4,000 rows then 600 conversations
        report = validate_source(str(BUNDLED / f"{part}.jsonl"))
        assert report.ok, report.issues[:3]
        assert report.n_rows == n


def test_catalogue_is_large_typed_and_split() -> None:
    assert len(CATALOGUE) >= 24 and len(BASE_TOOLS) + len(NEW_TOOLS) == len(CATALOGUE)
    assert not {t.name for t in BASE_TOOLS} & {t.name for t in NEW_TOOLS}
    assert 0.25 <= len(NEW_TOOLS) / len(CATALOGUE) <= 0.4
    types = {p.type for t in CATALOGUE for p in t.params}
    assert types >= {"string", "integer", "number", "boolean", "enum"}
    assert all(len(t.templates) >= 2 for t in CATALOGUE)


def test_generation_is_deterministic_per_seed_and_part() -> None:
    assert generate_rows(50, "base", seed=3) == generate_rows(50, "base", seed=3)
    assert generate_rows(50, "base", seed=3) != generate_rows(50, "base", seed=4)
    with pytest.raises(ValueError, match="part"):
        generate_rows(1, "old")  # type: ignore[arg-type]


@pytest.mark.parametrize("part", ["base", "new"])
def test_rows_pick_from_offered_tools_and_copy_values(part: str) -> None:
    rows = generate_rows(800, part, seed=0)
    own = {t.name for t in (BASE_TOOLS if part == "base" else NEW_TOOLS)}
    n_off = n_multi = 0
    for row in rows:
        offered = [t["name"] for t in row["tools"]]
        assert 3 <= len(offered) <= 5 and len(set(offered)) == len(offered)
        if part == "base":
            assert set(offered) <= own  # base data never shows a held-out tool
        called = [a["name"] for a in row["answers"]]
        assert set(called) <= set(offered)
        if called:
            assert called[0] in own
        for answer in row["answers"]:
            for value in answer["arguments"].values():
                if not isinstance(value, bool):
                    assert str(value).lower() in row["query"].lower(), (value, row["query"])
        n_off += not called
        n_multi += len(called) == 2
    assert 0.15 < n_off / len(rows) < 0.25
    assert 0.15 < n_multi / len(rows) < 0.3
    assert len({r["query"] for r in rows}) > len(rows) / 2


def test_write_sample_writes_compact_utf8_jsonl(tmp_path: Path) -> None:
    paths = write_sample(tmp_path, seed=1, n_base=5, n_new=3, n_conversations=2)
    text = paths["new"].read_text(encoding="utf-8")
    assert text.endswith("\n") and len(text.splitlines()) == 5 and '", "' not in text
    assert [("messages" in json.loads(line)) for line in text.splitlines()] == [False] * 3 + [True] * 2
    assert validate_source(str(paths["base"])).ok


def test_conversations_are_valid_loops_whose_answers_use_the_results() -> None:
    from needle.data.conversation import calls_of
    from needle.data.sample_conversations import MAX_CHARS, OUTCOMES, generate_conversations
    from needle.data.schema import parse_row

    raw = generate_conversations(60, seed=0)
    assert raw == generate_conversations(60, seed=0) and raw != generate_conversations(60, seed=1)
    new = {t.name for t in NEW_TOOLS}
    for i, obj in enumerate(raw):
        assert len(json.dumps(obj, separators=(",", ":"))) <= MAX_CHARS
        row = parse_row(obj, f"conv:{i + 1}")  # validates roles, call ids, schemas
        roles = [m["role"] for m in row.messages]
        shape = ("answer", "chain", "error")[i % 3]
        assert roles == {"answer": ["user", "assistant", "tool", "assistant"],
                         "chain": ["user", "assistant", "tool", "assistant", "tool", "assistant"],
                         "error": ["user", "assistant", "tool", "assistant"]}[shape]  # fmt: skip
        calls = [c for m in row.messages if m["role"] == "assistant" for c in calls_of(m)]
        assert calls and {c["name"] for c in calls} <= new
        final = row.messages[-1]["content"]
        results = [json.loads(m["content"]) for m in row.messages if m["role"] == "tool"]
        if shape == "error":
            assert "error" in results[0] and results[0]["error"] in final and final.endswith("?")
            continue
        for call, result in zip(calls, results):
            assert OUTCOMES[call["name"]][1](call["arguments"], result) in final
