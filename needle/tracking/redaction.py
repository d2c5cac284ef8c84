"""Redaction and MLflow's size limits: what every tracker applies before anything is stored.

The lowest tracking layer: URI credentials hidden (``redact_uri``, ``RedactingFilter``,
``redact_logs``), secret-looking parameter names redacted, values clipped to MLflow's limits.
The tracker protocol (needle/tracking/tracker.py) and the MLflow tracker (needle/tracking/mlflow_tracker.py)
both import from here; ``needle.tracking.tracker`` re-exports every name.

    from needle.tracking.redaction import redact_uri, sanitize_params
    redact_uri("http://user:pw@host")       # 'http://user:***@host'
"""

from __future__ import annotations

import logging
import re
from typing import Any

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
