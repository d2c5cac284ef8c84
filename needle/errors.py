"""Errors that needle raises on bad input, each naming where and why."""

from __future__ import annotations

from dataclasses import dataclass


class NeedleError(Exception):
    """Base class of needle's user-facing errors."""


@dataclass(frozen=True)
class DataIssue:
    """One bad row: the file, the 1-based line, and the reason."""

    file: str
    line: int
    reason: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.reason}"


class DataError(NeedleError):
    """Input data failed validation; lists the first issues and the total."""

    def __init__(self, issues: list[DataIssue], limit: int = 20) -> None:
        self.issues = list(issues)
        shown = "\n".join(str(i) for i in self.issues[:limit])
        more = len(self.issues) - limit
        tail = f"\n... and {more} more" if more > 0 else ""
        super().__init__(f"{len(self.issues)} bad row(s):\n{shown}{tail}")


class CheckpointMismatchError(NeedleError):
    """A checkpoint was written by another config or another dataset."""


class CheckpointDamagedError(NeedleError):
    """A checkpoint cannot be used (unreadable, fails its checksum, or holds NaN/inf); names why."""


class NonFiniteLossError(NeedleError):
    """Training produced a NaN or infinite loss; the last good checkpoint is kept."""


class ModelImportError(NeedleError):
    """A model directory or hub id cannot be imported (or exported): names the file, key or field."""


class ModelNotFoundError(NeedleError, FileNotFoundError):
    """A model path that holds no model (needle's or Hugging Face's): a user mistake, exit 2."""


class UsageError(NeedleError):
    """A command-line argument that cannot work (a missing base, --out naming a file): exit 2, one line."""
