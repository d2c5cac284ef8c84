"""The synthetic generator: bundled files reproduce exactly, rows are valid, varied and copyable."""

from __future__ import annotations

from pathlib import Path

import pytest

from needle.data.load import validate_source
from needle.data.sample import BASE_TOOLS, CATALOGUE, NEW_TOOLS, generate_rows, write_sample

BUNDLED = Path(__file__).resolve().parents[2] / "data" / "sample"


def test_bundled_sample_regenerates_byte_identical_and_validates(tmp_path: Path) -> None:
    paths = write_sample(tmp_path)
    for part in ("base", "new"):
        assert paths[part].read_bytes() == (BUNDLED / f"{part}.jsonl").read_bytes(), part
    for part, n in (("base", 12000), ("new", 4000)):
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
    paths = write_sample(tmp_path, seed=1, n_base=5, n_new=3)
    text = paths["new"].read_text(encoding="utf-8")
    assert text.endswith("\n") and len(text.splitlines()) == 3 and '", "' not in text
    assert validate_source(str(paths["base"])).ok
