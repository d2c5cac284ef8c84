"""`needle data add` without a Prefect API: rows are validated (a bad row refuses every file, with
file:line, and nothing lands), copied under a content-named file, and the same rows twice land once."""

from __future__ import annotations

from pathlib import Path

import pytest


def test_data_add_lands_valid_rows_once(sample_data: dict[str, Path], bad_data: Path, bad_line: int, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:  # fmt: skip
    from needle_flows.cli import main
    from needle.data.load import source_digest

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    landing = tmp_path / "landing"
    assert main(["data", "add", str(sample_data["new"]), str(bad_data), "--landing", str(landing)]) == 2
    assert f"{bad_data}:{bad_line}: " in capsys.readouterr().err
    assert not landing.exists() or not any(landing.iterdir())  # all or nothing

    assert main(["data", "add", str(sample_data["new"]), "--landing", str(landing)]) == 0
    out = capsys.readouterr().out
    (landed,) = landing.iterdir()
    assert landed.read_bytes() == sample_data["new"].read_bytes() and landed.suffix == ".jsonl"
    rows = len(sample_data["new"].read_text().splitlines())
    assert "no Prefect API" in out and f"{rows} new row(s)" in out
    assert main(["data", "add", str(sample_data["new"]), "--landing", str(landing)]) == 0
    assert "nothing new landed" in capsys.readouterr().out and len(list(landing.iterdir())) == 1
    assert source_digest(str(landing)) == source_digest(str(sample_data["new"]))
