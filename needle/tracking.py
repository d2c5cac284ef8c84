"""Experiment tracking behind a small protocol: no-op, in-memory, MLflow, and prefixed trackers.

The training loop and the pipeline stages only see :class:`Tracker`; the orchestration shell
picks the implementation. :class:`MlflowTracker` writes to one existing MLflow run through
``MlflowClient`` with an explicit run id (MLflow's fluent "active run" is per thread, so a
tracker used from a Prefect task thread would otherwise open a second run) and buffers metrics
so the training loop never waits on one synchronous call per step.

    from needle.tracking import MlflowTracker
    tracker = MlflowTracker(run_id, "sqlite:////abs/path/mlflow.db")
    tracker.log_params({"lora.rank": 8, "hf_token": "..."})  # the token is logged as redacted
    tracker.log_metrics({"loss": 2.3}, step=10)
    tracker.finish()  # flushes, marks the run FINISHED
"""

from __future__ import annotations

import logging
import math
import re
import time
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

log = logging.getLogger(__name__)

REDACTED = "***redacted***"
# MLflow's limits (mlflow.utils.validation); batches larger than these are rejected.
MAX_PARAM_VALUE_CHARS = 6000
MAX_TAG_VALUE_CHARS = 8000
_MAX_METRICS_PER_BATCH = 1000
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


class MlflowTracker:
    """Logs to an existing MLflow run by id; metrics are buffered and sent with ``log_batch``.

    The buffer is flushed when it holds ``flush_every`` values, when ``flush_seconds`` have
    passed since the last flush (so the UI shows progress in long runs), and on ``finish``.
    """

    def __init__(
        self,
        run_id: str,
        tracking_uri: str | None = None,
        flush_every: int = 500,
        flush_seconds: float = 15.0,
        terminate_on_finish: bool = True,
    ) -> None:
        from mlflow.tracking import MlflowClient

        self.run_id = run_id
        self.client = MlflowClient(tracking_uri=tracking_uri)
        self.flush_every = max(1, flush_every)
        self.flush_seconds = flush_seconds
        self.terminate_on_finish = terminate_on_finish
        self._buffer: list[Any] = []
        self._last_flush = time.monotonic()
        self._truncated: list[str] = []

    def log_params(self, params: dict[str, Any]) -> None:
        """Log params (stringified, secrets redacted, over-long values truncated and noted)."""
        from mlflow.entities import Param, RunTag

        clean, truncated = sanitize_params(params)
        items = [Param(k, v) for k, v in clean.items()]
        for i in range(0, len(items), _MAX_PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=items[i : i + _MAX_PARAMS_PER_BATCH], synchronous=True)
        if truncated:
            self._truncated.extend(truncated)
            log.warning(
                "params truncated to %d chars for MLflow: %s", MAX_PARAM_VALUE_CHARS, ", ".join(truncated)
            )
            self.client.log_batch(
                self.run_id, tags=[RunTag(TRUNCATED_TAG, ",".join(self._truncated))], synchronous=True
            )

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Buffer one step's metrics; flush when the buffer or the clock says so."""
        from mlflow.entities import Metric

        now_ms = int(time.time() * 1000)
        for key, value in metrics.items():
            number = float(value)
            # MLflow stores NaN but rejects +-inf on some stores; keep the signal as a large number.
            if math.isinf(number):
                number = math.copysign(1e308, number)
            self._buffer.append(Metric(key, number, now_ms, int(step)))
        if len(self._buffer) >= self.flush_every or time.monotonic() - self._last_flush >= self.flush_seconds:
            self.flush()

    def flush(self) -> None:
        """Send buffered metrics in batches of MLflow's maximum size."""
        buffer, self._buffer = self._buffer, []
        for i in range(0, len(buffer), _MAX_METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=buffer[i : i + _MAX_METRICS_PER_BATCH], synchronous=True)
        self._last_flush = time.monotonic()

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        """Upload a file, or a directory's contents, under ``artifact_path``."""
        p = Path(path)
        if p.is_dir():
            self.client.log_artifacts(self.run_id, str(p), artifact_path)
        else:
            self.client.log_artifact(self.run_id, str(p), artifact_path)

    def set_tags(self, tags: dict[str, Any]) -> None:
        """Set run tags (values stringified; secret-looking keys and URI credentials redacted)."""
        from mlflow.entities import RunTag

        items = [RunTag(k, _clip_tag(REDACTED if is_secret_key(k) else redact_uri(str(v)))) for k, v in tags.items()]
        for i in range(0, len(items), _MAX_PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, tags=items[i : i + _MAX_PARAMS_PER_BATCH], synchronous=True)

    def finish(self, status: str = "FINISHED") -> None:
        """Flush metrics and, unless the owner ends the run itself, mark it terminated."""
        self.flush()
        if self.terminate_on_finish:
            self.client.set_terminated(self.run_id, status=status)


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
