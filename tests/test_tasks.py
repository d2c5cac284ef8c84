"""The Prefect shell's retry policy: deterministic failures are not retried."""

from __future__ import annotations

from prefect.states import Failed

from needle.errors import DataError, DataIssue, NonFiniteLossError
from needle_tasks.stages import transient_only


def test_retry_only_failures_that_may_not_recur() -> None:
    assert transient_only(None, None, Failed(data=OSError("disk hiccup")))  # type: ignore[arg-type]
    for exc in (DataError([DataIssue("x.jsonl", 3, "not valid JSON")]), NonFiniteLossError("nan"), ValueError("bad")):
        assert not transient_only(None, None, Failed(data=exc))  # type: ignore[arg-type]
