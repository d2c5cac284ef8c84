"""The MLflow tracker: metrics through a bounded background buffer, so tracking never stops training.

:class:`MlflowTracker` writes to one existing MLflow run through ``MlflowClient`` with an explicit
run id (MLflow's fluent "active run" is per thread, so a tracker used from a Prefect task thread
would otherwise open a second run). An outage is a warning: metrics are kept, retried, and at
the end either delivered or written to a spill file that :func:`upload_pending_metrics` sends
on a later run. :func:`check_tracking` fails in seconds when a run cannot be tracked at all.

    from needle.tracking.mlflow_tracker import MlflowTracker, check_tracking
    check_tracking(uri)                                  # TrackingUnavailableError, URI redacted
    tracker = MlflowTracker(run_id, uri, spill_dir=".state/pending-metrics")
    tracker.log_params({"lora.rank": 8, "hf_token": "..."})  # the token is logged as redacted
    tracker.log_metrics({"loss": 2.3}, step=10)          # never blocks
    tracker.finish()                                     # delivers (or spills), marks the run FINISHED
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

from needle.errors import NeedleError
from needle.tracking.redaction import (
    MAX_PARAM_VALUE_CHARS, REDACTED, TRUNCATED_TAG, _MAX_PARAMS_PER_BATCH, _clip_tag, is_secret_key, redact_uri, sanitize_params,
)  # fmt: skip

log = logging.getLogger(__name__)

HEARTBEAT_TAG = "needle.heartbeat"
_MAX_METRICS_PER_BATCH = 1000


class TrackingUnavailableError(NeedleError):
    """The tracking store cannot be reached at the start of a run: one line, the URI redacted."""


class MlflowTracker:
    """Logs to an existing MLflow run by id; metrics go through a bounded buffer that a
    background thread sends with ``log_batch``, so the training loop never waits on MLflow.

    The sender sends when the buffer holds ``flush_every`` values or ``flush_seconds`` have
    passed. When MLflow cannot be reached it warns once, keeps the values (up to ``max_buffer``;
    beyond that the oldest go to the spill file) and retries with backoff; training goes on.
    ``finish`` waits up to ``finish_timeout`` seconds for delivery, then writes what is left to
    ``spill_dir/<run_id>.jsonl``, which :func:`upload_pending_metrics` sends on a later run. The
    sender also stamps tag ``needle.heartbeat`` (unix seconds), so a later run can tell a run
    whose process died from one that is still training (see needle_flows.run_record).
    """

    def __init__(
        self,
        run_id: str,
        tracking_uri: str | None = None,
        flush_every: int = 500,
        flush_seconds: float = 15.0,
        terminate_on_finish: bool = True,
        max_buffer: int = 200_000,
        spill_dir: str | Path | None = None,
        finish_timeout: float = 60.0,
        heartbeat_seconds: float = 60.0,
    ) -> None:
        from mlflow.tracking import MlflowClient

        self.run_id = run_id
        self.client = MlflowClient(tracking_uri=tracking_uri)
        self.uri = str(self.client.tracking_uri)
        self.flush_every = max(1, flush_every)
        self.flush_seconds = flush_seconds
        self.terminate_on_finish = terminate_on_finish
        self.max_buffer = max(1, max_buffer)
        self.spill_dir = None if spill_dir is None else Path(spill_dir)
        self.finish_timeout = finish_timeout
        self.heartbeat_seconds = heartbeat_seconds
        self._buffer: deque[Any] = deque()
        self._cond = threading.Condition()
        self._in_flight = 0
        self._flushing = 0
        self._closed = False
        self._outage_since: float | None = None
        self._last_beat = 0.0
        self._spilled = 0
        self._sender: threading.Thread | None = None
        self._truncated: list[str] = []

    # -- params, tags, artifacts: synchronous (they happen between stages, not per step) --

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

    # -- metrics: buffered, sent by a background thread --

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Queue one step's metrics; never blocks on MLflow."""
        from mlflow.entities import Metric

        now_ms = int(time.time() * 1000)
        items = []
        for key, value in metrics.items():
            number = float(value)
            # MLflow stores NaN but rejects +-inf on some stores; keep the signal as a large number.
            if math.isinf(number):
                number = math.copysign(1e308, number)
            items.append(Metric(key, number, now_ms, int(step)))
        with self._cond:
            self._buffer.extend(items)
            overflow = len(self._buffer) - self.max_buffer
            if overflow > 0:  # a long outage: the oldest values leave memory for the spill file
                self._spill([self._buffer.popleft() for _ in range(overflow)])
            if len(self._buffer) >= self.flush_every:
                self._cond.notify()
        self._ensure_sender()

    @property
    def pending(self) -> int:
        """Metric values not yet delivered to MLflow (queued or in flight)."""
        with self._cond:
            return len(self._buffer) + self._in_flight

    def flush(self, timeout: float | None = None) -> bool:
        """Wake the sender and wait until the buffer is delivered (at most ``timeout`` seconds,
        default ``finish_timeout``); True when nothing is left."""
        self._ensure_sender()
        deadline = time.monotonic() + (self.finish_timeout if timeout is None else timeout)
        with self._cond:
            self._flushing += 1
            try:
                self._cond.notify_all()
                while self._buffer or self._in_flight:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    self._cond.wait(min(left, 0.5))
                return True
            finally:
                self._flushing -= 1

    def finish(self, status: str = "FINISHED") -> None:
        """Deliver (or spill) the metrics, stop the sender and, unless the owner ends the run
        itself, mark it terminated."""
        delivered = self.flush()
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._sender is not None:
            self._sender.join(timeout=self.finish_timeout + 5)
        if not delivered:
            with self._cond:
                left = list(self._buffer)
                self._buffer.clear()
            self._spill(left)
        if self._spilled:
            where = self._spill_path() or "nowhere (no spill_dir)"
            log.warning("MLflow at %s did not take %d metric value(s); written to %s for the next run to upload",
                        redact_uri(self.uri), self._spilled, where)
        if self.terminate_on_finish:
            self.client.set_terminated(self.run_id, status=status)

    def _ensure_sender(self) -> None:
        if self._sender is None or not self._sender.is_alive():
            with self._cond:
                self._closed = False
            self._sender = threading.Thread(target=self._send_loop, name=f"mlflow-metrics-{self.run_id[:8]}", daemon=True)
            self._sender.start()

    def _send_loop(self) -> None:
        backoff = 1.0
        while True:
            with self._cond:
                # Wait for a full buffer, the clock, a flush or the end (a retry after an
                # outage has already waited its backoff).
                due = time.monotonic() + self.flush_seconds
                while (backoff == 1.0 and len(self._buffer) < self.flush_every and not self._flushing
                       and not self._closed and time.monotonic() < due):
                    self._cond.wait(min(due - time.monotonic(), 3600.0))
                if not self._buffer:
                    if self._closed:
                        return
                    batch = []
                else:
                    batch = [self._buffer.popleft() for _ in range(min(len(self._buffer), _MAX_METRICS_PER_BATCH))]
                self._in_flight = len(batch)
            ok = self._deliver(batch)
            with self._cond:
                self._in_flight = 0
                if not ok:
                    self._buffer.extendleft(reversed(batch))  # keep their order at the front
                self._cond.notify_all()
                if not ok:
                    if self._closed:
                        return  # finish gave up waiting: what is left is spilled there
                    self._cond.wait(backoff)
                    backoff = min(backoff * 2, 30.0)
                else:
                    backoff = 1.0

    def _deliver(self, batch: list[Any]) -> bool:
        """Send one batch (and the heartbeat when due); False, with one warning per outage, on failure."""
        from mlflow.entities import RunTag

        try:
            if not tracking_reachable(self.uri):
                raise ConnectionError("not reachable")
            now = time.time()
            tags = []
            if now - self._last_beat >= self.heartbeat_seconds:
                tags = [RunTag(HEARTBEAT_TAG, str(int(now)))]
            if batch or tags:
                self.client.log_batch(self.run_id, metrics=batch, tags=tags, synchronous=True)
            if tags:
                self._last_beat = now
        except Exception as exc:  # any failure to deliver is an outage: keep the values, retry
            if self._outage_since is None:
                self._outage_since = time.monotonic()
                log.warning("MLflow at %s is unreachable (%s); training goes on, %d metric value(s) kept "
                            "and retried", redact_uri(self.uri), redact_uri(type(exc).__name__ + ": " + str(exc))[:300],
                            len(batch) + len(self._buffer))
            return False
        if self._outage_since is not None:
            log.warning("MLflow at %s is back after %.0f s; sending the kept metrics", redact_uri(self.uri),
                        time.monotonic() - self._outage_since)
            self._outage_since = None
        return True

    def _spill_path(self) -> Path | None:
        return None if self.spill_dir is None else self.spill_dir / f"{self.run_id}.jsonl"

    def _spill(self, metrics: list[Any]) -> None:
        """Append metric values to the spill file (or count them lost when there is none)."""
        if not metrics:
            return
        path = self._spill_path()
        self._spilled += len(metrics)
        if path is None:
            log.warning("MLflow metrics buffer full and no spill_dir: %d value(s) lost", len(metrics))
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8") as fh:
            for m in metrics:
                fh.write(json.dumps({"key": m.key, "value": m.value, "timestamp": m.timestamp, "step": m.step}) + "\n")


def tracking_reachable(uri: str, timeout: float = 3.0) -> bool:
    """For an HTTP tracking URI, whether the server answers at all (any HTTP status counts) within
    ``timeout`` seconds, without MLflow's own minutes of retries; other stores count as reachable."""
    if not uri.startswith(("http://", "https://")):
        return True
    import requests

    try:
        requests.get(uri.rstrip("/") + "/health", timeout=timeout)
    except requests.RequestException:
        return False
    return True


def check_tracking(uri: str, timeout: float = 5.0) -> None:
    """Fail in seconds, naming the (redacted) URI, when runs cannot be tracked at ``uri``."""
    if uri.startswith(("http://", "https://")):
        if not tracking_reachable(uri, timeout):
            raise TrackingUnavailableError(
                f"MLflow tracking server {redact_uri(uri)} is not reachable (no answer within {timeout:.0f} s): "
                "start it, or unset MLFLOW_TRACKING_URI to track in the local SQLite store"
            )
    elif uri.startswith("sqlite:///"):
        db = Path(uri[len("sqlite:///"):])
        try:
            db.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise TrackingUnavailableError(f"MLflow store {uri}: cannot create {db.parent}: {exc.strerror}") from None


def upload_pending_metrics(client: Any, spill_dir: str | Path) -> dict[str, int]:
    """Send metrics that an earlier run spilled (``<run_id>.jsonl`` files) to their runs; a file
    is removed once delivered. Returns values delivered per run id."""
    from mlflow.entities import Metric

    sent: dict[str, int] = {}
    for path in sorted(Path(spill_dir).glob("*.jsonl")) if Path(spill_dir).is_dir() else []:
        rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        metrics = [Metric(r["key"], float(r["value"]), int(r["timestamp"]), int(r["step"])) for r in rows]
        for i in range(0, len(metrics), _MAX_METRICS_PER_BATCH):
            client.log_batch(path.stem, metrics=metrics[i : i + _MAX_METRICS_PER_BATCH], synchronous=True)
        path.unlink()
        sent[path.stem] = len(metrics)
        log.info("uploaded %d metric value(s) that run %s could not send earlier", len(metrics), path.stem)
    return sent
