"""Experiment tracking behind a small protocol: no-op, in-memory and prefixed trackers, and the
redaction every tracker applies (URI credentials, secret-looking param names).

The training loop and the pipeline stages only see :class:`Tracker`; the orchestration shell
picks the implementation: the MLflow one is needle.mlflow_tracker.MlflowTracker (also importable
from here), which buffers metrics in a background thread so training never waits on MLflow.

    from needle.tracking import MemoryTracker, PrefixedTracker, redact_uri
    tracker = PrefixedTracker(MemoryTracker(), "base/")
    tracker.log_metrics({"loss": 2.3}, step=10)   # recorded as base/loss
    redact_uri("http://user:pw@host")             # 'http://user:***@host'
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

log = logging.getLogger(__name__)

REDACTED = "***redacted***"
# MLflow's limits (mlflow.utils.validation); batches larger than these are rejected.
MAX_PARAM_VALUE_CHARS = 6000
MAX_TAG_VALUE_CHARS = 8000
_MAX_PARAMS_PER_BATCH = 100
TRUNCATED_TAG = "needle.truncated_params"
# Whole words of a key, so "max_new_tokens" or "keep_checkpoints" stay visible while
# "hf_token", "api-key" or "db.password" are redacted.
_SECRET_WORDS = frozenset(
    {"token", "password", "passwd", "secret", "key", "apikey", "credential", "credentials"}
)


# scheme://userinfo@ : the userinfo of a URI anywhere in a text (a URL, an error message).
_URI_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]*://)(?P<user>[^\s/@:?#]*)(?::[^\s/@?#]*)?@")


def redact_uri(text: str) -> str:
    """``text`` with the credentials of every URI in it hidden: ``http://user:pw@host`` becomes
    ``http://user:***@host`` (a bare token, ``https://tok@host``, becomes ``https://***@host``).

    Used wherever a tracking URI (or an error that may quote it) is printed, logged or stored.
    """

    def hide(m: re.Match[str]) -> str:
        has_password = m.group(0).count(":") > 1
        return m.group("scheme") + (f"{m.group('user')}:***@" if has_password else "***@")

    return _URI_USERINFO.sub(hide, text)


class RedactingFilter(logging.Filter):
    """A handler filter that applies :func:`redact_uri` to each record's message and traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        """Rewrite the record in place; never drops it."""
        message = record.getMessage()
        record.msg, record.args = redact_uri(message), None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact_uri(record.exc_text)
        return True


def redact_logs(prefixes: tuple[str, ...] = ("prefect", "needle", "mlflow")) -> None:
    """Put a :class:`RedactingFilter` on every handler of the root logger and of the loggers
    under ``prefixes`` (once each), so URI credentials never reach a console or a log store."""
    names = [n for n in list(logging.root.manager.loggerDict) if n.split(".")[0] in prefixes]
    loggers = [logging.getLogger()] + [logging.getLogger(n) for n in names]
    for handler in {h for lg in loggers for h in lg.handlers}:
        if not any(isinstance(f, RedactingFilter) for f in handler.filters):
            handler.addFilter(RedactingFilter())


def is_secret_key(key: str) -> bool:
    """True when a parameter name looks like it holds a credential."""
    words = re.split(r"[^a-z0-9]+", re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", key).lower())
    return any(w in _SECRET_WORDS for w in words)


def sanitize_params(params: dict[str, Any]) -> tuple[dict[str, str], list[str]]:
    """Stringify values, redact secret-looking keys and URI credentials, truncate to MLflow's limit.

    Returns the clean params and the keys that were truncated, so the caller can record it.
    """
    clean: dict[str, str] = {}
    truncated: list[str] = []
    for key, value in params.items():
        text = REDACTED if is_secret_key(key) else redact_uri(str(value))
        if len(text) > MAX_PARAM_VALUE_CHARS:
            truncated.append(key)
            text = text[:MAX_PARAM_VALUE_CHARS]
        clean[key] = text
    return clean, truncated


def _clip_tag(text: str) -> str:
    """Fit a tag value into MLflow's limit, saying so in the value itself."""
    if len(text) <= MAX_TAG_VALUE_CHARS:
        return text
    marker = f"... [truncated from {len(text)} chars]"
    return text[: MAX_TAG_VALUE_CHARS - len(marker)] + marker


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


_MLFLOW_NAMES = {"MlflowTracker", "TrackingUnavailableError", "HEARTBEAT_TAG", "check_tracking",
                 "tracking_reachable", "upload_pending_metrics"}


def __getattr__(name: str) -> Any:
    """The MLflow tracker lives in needle.mlflow_tracker; ``from needle.tracking import
    MlflowTracker`` keeps working without importing it for users of the protocol alone."""
    if name in _MLFLOW_NAMES:
        from needle import mlflow_tracker

        return getattr(mlflow_tracker, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
