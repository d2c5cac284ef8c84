"""Experiment tracking behind a small protocol: no-op, in-memory and prefixed trackers.

The training loop and the pipeline stages only see :class:`Tracker`; the orchestration shell
picks the implementation: the MLflow one is needle.tracking.mlflow_tracker.MlflowTracker, which
buffers metrics in a background thread so training never waits on MLflow. What every tracker
strips or clips (URI credentials, secret-looking param names) is needle/tracking/redaction.py.

    from needle.tracking.tracker import MemoryTracker, PrefixedTracker
    tracker = PrefixedTracker(MemoryTracker(), "base/")
    tracker.log_metrics({"loss": 2.3}, step=10)   # recorded as base/loss
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

log = logging.getLogger(__name__)


@runtime_checkable
class Tracker(Protocol):
    """What training and evaluation may report; implementations decide where it goes."""

    def log_params(self, params: dict[str, Any]) -> None: ...

    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None: ...

    def set_tags(self, tags: dict[str, Any]) -> None: ...

    def finish(self, status: str = "FINISHED") -> None: ...


class NoopTracker:
    """Discards everything: for library use, tests and runs without tracking."""

    def log_params(self, params: dict[str, Any]) -> None:
        """Ignore params."""

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Ignore metrics."""

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        """Ignore artifacts."""

    def set_tags(self, tags: dict[str, Any]) -> None:
        """Ignore tags."""

    def finish(self, status: str = "FINISHED") -> None:
        """Nothing to finish."""


class MemoryTracker(NoopTracker):
    """Keeps params, metrics ``(step, metrics)`` and tags in memory: for tests and library users."""

    def __init__(self) -> None:
        self.params: dict[str, Any] = {}
        self.metrics: list[tuple[int, dict[str, float]]] = []
        self.tags: dict[str, Any] = {}

    def log_params(self, params: dict[str, Any]) -> None:
        """Keep params (a later value replaces an earlier one)."""
        self.params.update(params)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Keep one step's metrics."""
        self.metrics.append((step, dict(metrics)))

    def set_tags(self, tags: dict[str, Any]) -> None:
        """Keep tags."""
        self.tags.update(tags)


class PrefixedTracker:
    """Puts a prefix on param, metric and tag names (``base/loss``), so a base model's training
    shares a run with the fine-tuning without clashing keys; ``finish`` flushes the inner one."""

    def __init__(self, inner: Tracker, prefix: str) -> None:
        self.inner, self.prefix = inner, prefix

    def log_params(self, params: dict[str, Any]) -> None:
        """Log params under the prefix."""
        self.inner.log_params({self.prefix + k: v for k, v in params.items()})

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Log metrics under the prefix."""
        self.inner.log_metrics({self.prefix + k: v for k, v in metrics.items()}, step)

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        """Log an artifact under the prefix folder."""
        self.inner.log_artifact(path, self.prefix.rstrip("/.") + (f"/{artifact_path}" if artifact_path else ""))

    def set_tags(self, tags: dict[str, Any]) -> None:
        """Set tags under the prefix."""
        self.inner.set_tags({self.prefix + k: v for k, v in tags.items()})

    def finish(self, status: str = "FINISHED") -> None:
        """Flush the inner tracker."""
        self.inner.finish(status)
