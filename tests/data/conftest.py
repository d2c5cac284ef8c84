"""Fixtures for the data tests: a JSONL writer and a small trained tokenizer."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from needle.tokenizers.native import Tokenizer


@pytest.fixture
def write_jsonl(tmp_path: Path) -> Callable[..., Path]:
    """write_jsonl(lines, name) -> path; dict lines are JSON-encoded, str/bytes written as is."""

    def write(lines: list[Any], name: str = "rows.jsonl") -> Path:
        chunks = []
        for line in lines:
            if isinstance(line, dict):
                line = json.dumps(line)
            chunks.append(line if isinstance(line, bytes) else line.encode("utf-8"))
        path = tmp_path / name
        path.write_bytes(b"\n".join(chunks) + (b"\n" if chunks else b""))
        return path

    return write


@pytest.fixture(scope="session")
def data_tokenizer() -> Tokenizer:
    """A byte-level BPE trained on a few dozen synthetic rows (a second or so)."""
    from needle.data.prepare import collect_texts
    from needle.data.schema import parse_row
    from needle.data.sample import generate_rows
    from needle.tokenizers.native import train_tokenizer

    rows = [parse_row(r, f"gen:{i}") for i, r in enumerate(generate_rows(60, "base", seed=1))]
    return train_tokenizer(collect_texts(rows), vocab_size=400)
