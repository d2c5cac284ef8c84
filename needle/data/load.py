"""Read and validate tool-calling rows from JSONL files, folders, globs, or a Hugging Face hub id.

Every bad line becomes a ``DataIssue`` printed as ``file:line: reason`` (not UTF-8, not JSON,
not an object, a missing or ill-typed field, an undeclared tool, a missing or ill-typed
argument, an empty file; for a conversation row, the message index too: ``messages[3] (tool):
tool_call_id 'c9' answers no earlier call of this conversation``). ``on_error="fail"`` raises ``DataError`` listing them;
``"drop"`` keeps the good rows and returns the issues so the caller can report them.
Blank lines are skipped (JSONL convention), but a file without a single row is an error.
Reading is bounded (``needle.data.schema.loads_bounded``): a line over ``MAX_ROW_BYTES``, nested
too deep, with a non-finite number or a lone surrogate is a ``file:line`` issue, and nothing
is fetched over the network while checking tool schemas.

A folder (its ``*.jsonl``, e.g. a landing folder that grows) or a glob is read in name order
and fingerprinted by content: the digest is over the sorted per-file digests, so names and
mtimes play no part. A hub id may pin a revision: ``owner/name@revision``.

    rows, issues = read_rows("data/sample/base.jsonl")
    print(format_validation(validate_source("data/*.jsonl")))
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Any, Literal

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from datasets.table import InMemoryTable

from needle.data.bounds import MAX_ROW_BYTES, loads_bounded
from needle.data.conversation import derived_fields
from needle.data.schema import Row, parse_row, row_to_dict
from needle.errors import DataError, DataIssue

OnError = Literal["fail", "drop"]
LOCAL_SUFFIXES = (".jsonl", ".json", ".ndjson")

# Every column is a plain string: tools/answers/messages travel as JSON text (see row_to_record).
ROW_COLUMNS = ("query", "tools", "answers", "reasoning", "system", "source", "messages")
ROW_FEATURES = datasets.Features({k: datasets.Value("string") for k in ROW_COLUMNS})


@dataclass(frozen=True)
class LoadedSource:
    """Rows and issues of a source, plus what was read (for the data fingerprint)."""

    rows: list[Row]
    issues: list[DataIssue]
    files: list[str]
    digest: str  # content digest: see file_digest and combine_digests (names and mtimes play no part)


@dataclass(frozen=True)
class ValidationReport:
    """Outcome of :func:`validate_source`."""

    ok: bool
    n_rows: int
    n_files: int
    issues: list[DataIssue] = field(default_factory=list)


def resolve_files(source: str) -> list[str] | None:
    """Local files named by ``source`` (file, directory of .jsonl, or glob), sorted.

    Returns ``None`` when ``source`` is not local and should be read from the hub;
    raises ``DataError`` when it is clearly local but matches nothing.
    """
    if os.path.isdir(source):
        files = sorted(glob.glob(os.path.join(source, "*.jsonl")))
        if not files:
            raise DataError([DataIssue(source, 0, "directory holds no .jsonl files")])
        return files
    if os.path.isfile(source):
        return [source]
    if glob.has_magic(source):
        files = sorted(p for p in glob.glob(source, recursive=True) if os.path.isfile(p))
        if not files:
            raise DataError([DataIssue(source, 0, "no files match this pattern")])
        return files
    if source.endswith(LOCAL_SUFFIXES) or source.startswith((".", "/", "~")):
        raise DataError([DataIssue(source, 0, "no such file")])
    return None


def _decode_line(raw: bytes, lineno: int) -> str:
    if len(raw) > MAX_ROW_BYTES:
        raise ValueError(f"line is {len(raw):,} bytes, over the limit of {MAX_ROW_BYTES:,} (MAX_ROW_BYTES)")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"line is not valid UTF-8 (byte 0x{raw[exc.start]:02x} at column {exc.start + 1})") from None
    return text.lstrip("\ufeff") if lineno == 1 else text


def _parse_line(text: str, source: str) -> Row:
    try:
        obj = loads_bounded(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON: {exc.msg} (column {exc.colno})") from None
    return parse_row(obj, source, parsed_bounded=True)


def _bytes_digest(data: bytes) -> str:
    # Length-prefixed, as the single-file digest has always been computed.
    hasher = hashlib.sha256(len(data).to_bytes(8, "little"))
    hasher.update(data)
    return hasher.hexdigest()


def file_digest(path: str) -> str:
    """The content digest of one file (sha256 of its length and bytes)."""
    with open(path, "rb") as fh:
        return _bytes_digest(fh.read())


def combine_digests(digests: list[str]) -> str:
    """A source's digest from its files' digests: one file's own digest; for several, sha256 over
    the sorted digests, so a folder or glob is fingerprinted by the contents it holds, whatever
    the files are called (renaming or touching a file changes nothing; adding one does)."""
    if len(digests) == 1:
        return digests[0]
    return hashlib.sha256("\n".join(sorted(digests)).encode()).hexdigest()


def source_digest(source: str) -> str | None:
    """The content digest of a local source without parsing its rows (the fingerprint a run
    compares first, in a fraction of validation's time); ``None`` for a hub id, whose rows must
    be loaded to know it. Equal to ``load_source(source).digest`` for local sources."""
    files = resolve_files(source)
    return None if files is None else combine_digests([file_digest(f) for f in files])


def _read_file(path: str, digests: list[str]) -> tuple[list[Row], list[DataIssue]]:
    with open(path, "rb") as fh:
        data = fh.read()
    digests.append(_bytes_digest(data))
    rows: list[Row] = []
    issues: list[DataIssue] = []
    n_nonblank = 0
    for i, raw in enumerate(data.split(b"\n")):
        lineno = i + 1
        if not raw.strip():
            continue
        n_nonblank += 1
        try:
            text = _decode_line(raw.rstrip(b"\r"), lineno)
            rows.append(_parse_line(text, f"{path}:{lineno}"))
        except ValueError as exc:
            issues.append(DataIssue(path, lineno, str(exc)))
    if not data:
        issues.append(DataIssue(path, 1, "file is empty"))
    elif n_nonblank == 0:
        issues.append(DataIssue(path, 1, "file has no rows (only blank lines)"))
    return rows, issues


def _strip_nulls(value: Any) -> Any:
    # Arrow gives every struct in a column the union of all keys, filling the missing ones
    # with null; dropping nulls restores the original objects (a genuine null argument is
    # lost too: publish tools/answers as JSON strings to keep one).
    if isinstance(value, dict):
        return {k: _strip_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_strip_nulls(v) for v in value]
    return value


def _read_hub(source: str, hasher: Any) -> tuple[list[Row], list[DataIssue]]:
    # owner/name@revision pins a commit, branch or tag of the dataset repository.
    name, _, revision = source.partition("@")
    try:
        ds = datasets.load_dataset(name, revision=revision or None, split="train")
    except Exception as exc:  # the hub raises many types; all mean "cannot read this source"
        raise DataError([DataIssue(source, 0, f"cannot load from the Hugging Face hub: {exc}")]) from exc
    rows: list[Row] = []
    issues: list[DataIssue] = []
    for i, rec in enumerate(ds):
        obj = {k: (v if isinstance(v, str) else _strip_nulls(v)) for k, v in rec.items()}
        size = sum(len(v) for v in obj.values() if isinstance(v, str))
        try:
            if size > MAX_ROW_BYTES:
                raise ValueError(f"row has {size:,} characters of text, over the limit of {MAX_ROW_BYTES:,}")
            rows.append(parse_row(obj, f"{source}:{i + 1}"))
        except ValueError as exc:
            issues.append(DataIssue(source, i + 1, str(exc)))
    for row in rows:
        hasher.update(json.dumps(row_to_dict(row), sort_keys=True).encode("utf-8"))
    if not rows and not issues:
        issues.append(DataIssue(source, 1, "dataset is empty"))
    return rows, issues


def row_to_record(row: Row) -> dict[str, Any]:
    """A row as a flat record of strings (the ``ROW_FEATURES`` columns); see :func:`record_to_row`.

    tools/answers are stored as JSON strings on purpose: arrow would otherwise unify the
    nested dict keys across rows and add ``null`` keys to every tool's JSON schema and every
    call's arguments, which changes what the model sees and breaks argument checks.
    A conversation row stores its ``messages`` (JSON) and ``tools`` only: its query/answers
    columns are null, since they are derived from the messages (and a row holding both
    layouts would be refused when read back with ``parse_row``).
    """
    if row.messages is not None:
        return {"query": None, "tools": json.dumps(row.tools, ensure_ascii=False), "answers": None,
                "reasoning": None, "system": None, "source": row.source,
                "messages": json.dumps(row.messages, ensure_ascii=False)}  # fmt: skip
    return {
        "query": row.query,
        "tools": json.dumps(row.tools, ensure_ascii=False),
        "answers": json.dumps(row.answers, ensure_ascii=False),
        "reasoning": row.reasoning,
        "system": row.system,
        "source": row.source,
        "messages": None,
    }


def record_to_row(record: dict[str, Any]) -> Row:
    """The row of a record written by :func:`row_to_record` (already validated: no re-check).

    A record prepared before conversations existed has no ``messages`` column: a query/answers row."""
    if record.get("messages") is not None:
        messages = json.loads(record["messages"])
        query, answers, reasoning, system = derived_fields(messages)
        return Row(query=query, tools=json.loads(record["tools"]), answers=answers, reasoning=reasoning,
                   system=system, source=record["source"], messages=messages)  # fmt: skip
    return Row(
        query=record["query"],
        tools=json.loads(record["tools"]),
        answers=json.loads(record["answers"]),
        reasoning=record["reasoning"],
        system=record["system"],
        source=record["source"],
    )


def _feed_array(h: Any, arr: pa.Array) -> None:
    """Feed the values of ``arr`` to the sha256 ``h``: its type, length, null positions, then the
    valid values (lengths and bytes for strings; lengths then the flattened items for lists), as
    read through pyarrow, never its memory layout, so equal values always feed equal bytes."""
    h.update(f"|{arr.type}|{len(arr)}|".encode())
    h.update(arr.is_null().to_numpy(zero_copy_only=False).tobytes())
    valid = pc.drop_null(arr)  # a fresh array: offsets from 0, no bytes under null slots
    if pa.types.is_list(valid.type) or pa.types.is_large_list(valid.type):
        h.update(pc.list_value_length(valid).to_numpy().astype("<i8").tobytes())
        _feed_array(h, valid.flatten())
    elif any(is_(valid.type) for is_ in (pa.types.is_string, pa.types.is_large_string,
                                         pa.types.is_binary, pa.types.is_large_binary)):  # fmt: skip
        h.update(pc.binary_length(valid).to_numpy().astype("<i8").tobytes())
        valid = valid.cast(pa.large_binary())
        _, offsets, data = valid.buffers()
        ends = np.frombuffer(offsets, dtype="<i8")[valid.offset : valid.offset + len(valid) + 1]
        if data is not None and len(ends):
            h.update(memoryview(data)[int(ends[0]) : int(ends[-1])])
    elif pa.types.is_boolean(valid.type) or pa.types.is_integer(valid.type) or pa.types.is_floating(valid.type):
        h.update(np.ascontiguousarray(valid.to_numpy(zero_copy_only=False)).tobytes())
    else:
        raise TypeError(f"no content digest for arrow type {valid.type}")


def table_fingerprint(table: pa.Table, features: datasets.Features) -> str:
    """sha256 of ``features`` and the table's values, column by column (see ``_feed_array``):
    the ``datasets`` fingerprint of :func:`records_dataset`. Equal records and features give equal
    fingerprints anywhere, in a fraction of the time building the table takes. It names the arrow
    table only: needle's data fingerprint is ``needle.data.prepare.compute_fingerprint``."""
    h = hashlib.sha256(b"needle.records_dataset/1\n")
    h.update(json.dumps(features.to_dict(), sort_keys=True).encode("utf-8"))
    for name in table.column_names:
        h.update(f"\n{name}".encode("utf-8"))
        _feed_array(h, table.column(name).combine_chunks())
    return h.hexdigest()


def records_dataset(records: list[dict[str, Any]], features: datasets.Features) -> datasets.Dataset:
    """``datasets.Dataset.from_list(records, features=features)``, without ``datasets`` hashing.

    ``from_list``/``from_dict`` name a new dataset by pickling its whole arrow table with dill
    (``datasets.fingerprint.Hasher``), which fails where dill cannot reach pyarrow's types:
    pyarrow installed outside site-packages (``pip install --target`` on PYTHONPATH, as on the
    TPU image) gives ``PicklingError: Can't pickle <class 'MonthDayNano'>``. The same table
    (columns encoded as ``from_dict`` encodes them) is built here with pyarrow and named by
    :func:`table_fingerprint`, so building a dataset pickles nothing. Every record holds every
    column of ``features``; no records gives an empty dataset with all the columns.
    """
    schema = features.arrow_schema
    arrays = [pa.array(features.encode_column([r[name] for r in records], name), type=schema.field(name).type)
              for name in features]  # fmt: skip
    table = pa.Table.from_arrays(arrays, schema=schema)
    info = datasets.DatasetInfo(features=features)
    return datasets.Dataset(InMemoryTable(table), info=info, fingerprint=table_fingerprint(table, features))


def _through_datasets(rows: list[Row]) -> list[Row]:
    """Round-trip validated rows through an HF ``datasets.Dataset`` (string columns)."""
    ds = records_dataset([row_to_record(r) for r in rows], ROW_FEATURES)
    cols = ds[:]  # one columnar read: per-row iteration over arrow is far slower
    return [record_to_row(dict(zip(cols, values))) for values in zip(*cols.values())]


def _collect(source: str) -> LoadedSource:
    files = resolve_files(source)
    rows: list[Row] = []
    issues: list[DataIssue] = []
    if files is None:
        hasher = hashlib.sha256()
        rows, issues = _read_hub(source, hasher)
        return LoadedSource(rows, issues, [source], hasher.hexdigest())
    digests: list[str] = []
    for path in files:
        file_rows, file_issues = _read_file(path, digests)
        rows += file_rows
        issues += file_issues
    return LoadedSource(rows, issues, files, combine_digests(digests))


def load_source(source: str, on_error: OnError = "fail") -> LoadedSource:
    """Read, validate and apply the error policy; the loaded rows went through ``datasets``."""
    if on_error not in ("fail", "drop"):
        raise ValueError(f"on_error must be 'fail' or 'drop', got {on_error!r}")
    loaded = _collect(source)
    if loaded.issues and (on_error == "fail" or not loaded.rows):
        raise DataError(loaded.issues)
    return LoadedSource(_through_datasets(loaded.rows), loaded.issues, loaded.files, loaded.digest)


def read_rows(source: str, on_error: OnError = "fail") -> tuple[list[Row], list[DataIssue]]:
    """Rows of a JSONL path, glob, directory or hub id, and the issues of dropped rows.

    ``fail``: raise ``DataError`` on any issue. ``drop``: return the good rows and the
    issues; still raise when no good row is left.
    """
    loaded = load_source(source, on_error)
    return loaded.rows, loaded.issues


def validate_source(source: str) -> ValidationReport:
    """Check every row of ``source`` without raising; see :func:`format_validation`."""
    try:
        loaded = _collect(source)
    except DataError as exc:
        return ValidationReport(False, 0, 0, exc.issues)
    return ValidationReport(not loaded.issues, len(loaded.rows), len(loaded.files), loaded.issues)


def format_validation(report: ValidationReport, limit: int = 20) -> str:
    """One summary line when ok; otherwise the first ``limit`` issues and the total."""
    if report.ok:
        return f"ok: {report.n_rows} rows in {report.n_files} file(s)"
    lines = [str(i) for i in report.issues[:limit]]
    lines.append(f"... {len(report.issues)} bad rows in total ({report.n_rows} good rows in {report.n_files} file(s))")
    return "\n".join(lines)
