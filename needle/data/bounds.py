"""Bounded reading and checking of untrusted JSON: the limits of needle/data/schema.py's rows.

:func:`loads_bounded` refuses text over ``MAX_ROW_BYTES``, nesting deeper than ``MAX_DEPTH``,
non-finite numbers (``NaN``, ``Infinity``, ``1e400``) and lone surrogates (``\\ud800``);
:func:`check_arguments` validates a call's arguments against a tool's JSON schema, where a schema
may only ``$ref`` inside itself (nothing is fetched) and ``pattern`` / ``patternProperties`` run
on the ``regex`` engine with a per-match timeout (a timed-out pattern is refused from then on)
and a per-row budget (:func:`start_row_budget`). Split out of schema.py so that rows and
conversations (needle/data/conversation.py) share one set of bounds.
"""

from __future__ import annotations

import json
import math
import re
import time
from functools import lru_cache
from typing import Any

import regex
from jsonschema.exceptions import ValidationError
from jsonschema.validators import extend, validator_for
from referencing import Registry
from referencing.exceptions import NoSuchResource, Unresolvable

MAX_ROW_BYTES = 1_000_000  # one JSONL line (and one JSON-in-a-string field)
MAX_DEPTH = 64  # nesting of arrays and objects
PATTERN_TIMEOUT_S = 0.1  # one regex search of a tool schema's pattern / patternProperties
ROW_REGEX_BUDGET_S = 1.0  # all regex searches of one row together


_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')  # unrolled: no backtracking blow-up
_BRACKET = re.compile(r"[\[\]{}]")
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _check_depth(text: str) -> None:
    if text.count("[") + text.count("{") <= MAX_DEPTH:
        return
    depth = 0
    for ch in _BRACKET.findall(_JSON_STRING.sub("", text)):
        depth += 1 if ch in "[{" else -1
        if depth > MAX_DEPTH:
            raise ValueError(f"nested deeper than {MAX_DEPTH} levels of arrays/objects")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"not valid JSON: {name} is not allowed")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} is out of range (not a finite number)")
    return value


def check_surrogates(obj: Any) -> None:
    try:
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = ord(exc.object[exc.start])
        raise ValueError(f"string holds a lone surrogate \\u{bad:04x} (not valid Unicode)") from None


def loads_bounded(text: str) -> Any:
    """``json.loads`` for untrusted text: size, depth, finite numbers and valid Unicode checked.

    Raises ``json.JSONDecodeError`` for malformed JSON, ``ValueError(reason)`` for the rest.
    """
    if len(text) > MAX_ROW_BYTES:
        raise ValueError(f"{len(text):,} characters, over the limit of {MAX_ROW_BYTES:,} (MAX_ROW_BYTES)")
    _check_depth(text)
    obj = json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)
    if _SURROGATE_ESCAPE.search(text):
        check_surrogates(obj)
    return obj


def check_decoded(value: Any) -> None:
    """The checks :func:`loads_bounded` makes while parsing, for values that arrive already
    decoded (a hub dataset's struct columns, a Python caller): finite numbers, valid Unicode."""
    try:  # the C encoder does both checks in one pass
        json.dumps(value, allow_nan=False, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        check_surrogates(value)  # names the code point
    except ValueError:
        raise ValueError("a number is out of range (not a finite number: NaN or infinity)") from None
    except RecursionError:
        raise ValueError(f"nested deeper than {MAX_DEPTH} levels of arrays/objects") from None


def decode_json_field(value: Any, field: str, checked: bool = False) -> Any:
    if isinstance(value, str):
        try:
            return loads_bounded(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"'{field}' is a string but not valid JSON ({exc.msg})") from None
        except ValueError as exc:
            raise ValueError(f"'{field}' (a JSON string): {exc}") from None
    try:
        if not checked:
            check_decoded(value)
    except ValueError as exc:
        raise ValueError(f"'{field}': {exc}") from None
    return value



_SLOW_PATTERNS: set[str] = set()  # patterns that timed out once: refused from then on
_row_deadline = [math.inf]  # time.monotonic() by which the current row's regex searches must end


@lru_cache(maxsize=4096)
def _compiled(pattern: str) -> Any:
    try:
        return regex.compile(pattern)
    except regex.error as exc:
        raise ValueError(f"pattern {pattern!r} is not supported ({exc})") from None


def _search(pattern: str, text: str) -> bool:
    """``re.search`` on the ``regex`` engine, bounded by ``PATTERN_TIMEOUT_S`` and the row's budget."""
    if pattern in _SLOW_PATTERNS:
        raise ValueError(f"pattern {pattern!r} is refused: it ran past {PATTERN_TIMEOUT_S} s on an earlier row")
    left = _row_deadline[0] - time.monotonic()
    try:
        return _compiled(pattern).search(text, timeout=max(min(PATTERN_TIMEOUT_S, left), 1e-3)) is not None
    except TimeoutError:
        if left >= PATTERN_TIMEOUT_S:
            _SLOW_PATTERNS.add(pattern)
        raise ValueError(f"pattern {pattern!r} takes too long to check (over {PATTERN_TIMEOUT_S} s)") from None


def _kw_pattern(validator: Any, patrn: str, instance: Any, schema: Any) -> Any:
    if validator.is_type(instance, "string") and not _search(patrn, instance):
        yield ValidationError(f"{instance!r} does not match {patrn!r}")


def _kw_pattern_properties(validator: Any, patterns: dict[str, Any], instance: Any, schema: Any) -> Any:
    if not validator.is_type(instance, "object"):
        return
    for pattern, subschema in patterns.items():
        for key, value in instance.items():
            if _search(pattern, key):
                yield from validator.descend(value, subschema, path=key, schema_path=pattern)


def _kw_additional_properties(validator: Any, extra: Any, instance: Any, schema: Any) -> Any:
    """jsonschema's ``additionalProperties`` with its patternProperties matched by :func:`_search`."""
    patterns = schema.get("patternProperties", {})
    if not patterns or not validator.is_type(instance, "object"):
        yield from _ADDITIONAL_PROPERTIES(validator, extra, instance, schema)
        return
    props = schema.get("properties", {})
    extras = [k for k in instance if k not in props and not any(_search(p, k) for p in patterns)]
    if validator.is_type(extra, "object"):
        for key in extras:
            yield from validator.descend(instance[key], extra, path=key)
    elif not extra and extras:
        joined = ", ".join(repr(k) for k in sorted(extras))
        verb = "does" if len(extras) == 1 else "do"
        yield ValidationError(f"{joined} {verb} not match any of the regexes: {', '.join(map(repr, sorted(patterns)))}")


def _refuse_retrieval(uri: str) -> Any:
    raise NoSuchResource(ref=uri)


_ADDITIONAL_PROPERTIES = validator_for({}).VALIDATORS["additionalProperties"]  # the same function in every draft
_NO_FETCH = Registry(retrieve=_refuse_retrieval)  # type: ignore[call-arg]
_SAFE_KEYWORDS = {"pattern": _kw_pattern, "patternProperties": _kw_pattern_properties,
                  "additionalProperties": _kw_additional_properties}  # fmt: skip


@lru_cache(maxsize=None)
def _safe_class(cls: Any) -> Any:
    return extend(cls, _SAFE_KEYWORDS)


def _check_untrusted_schema(schema: Any) -> None:
    """Refuse what would fetch or could not be bounded: non-local refs, unevaluatedProperties with patterns."""
    stack, keys = [schema], set()
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for key, value in node.items():
                keys.add(key)
                if key in ("$ref", "$dynamicRef", "$recursiveRef") and isinstance(value, str):
                    if not value.startswith("#"):
                        raise ValueError(f"$ref {value[:80]!r} points outside the schema (only '#...' refs; nothing is fetched)")
                stack.append(value)
        elif isinstance(node, list):
            stack.extend(node)
    if "unevaluatedProperties" in keys and "patternProperties" in keys:
        raise ValueError("unevaluatedProperties together with patternProperties is not supported")


@lru_cache(maxsize=4096)
def schema_validator(schema_json: str) -> Any:
    # Rows repeat the same few tool schemas thousands of times: build each validator once.
    schema = json.loads(schema_json)
    _check_untrusted_schema(schema)
    cls = validator_for(schema)
    cls.check_schema(schema)
    return _safe_class(cls)(schema, registry=_NO_FETCH)


def check_arguments(name: str, args: dict[str, Any], params: dict[str, Any], where: str) -> None:
    props = params.get("properties", {})
    for req in params.get("required", []):
        if req not in args:
            raise ValueError(f"{where} ({name}) is missing required argument '{req}'")
    if params.get("additionalProperties") is False:
        extra = sorted(set(args) - set(props))
        if extra:
            raise ValueError(f"{where} ({name}) has undeclared argument '{extra[0]}'")
    try:
        errors = sorted(schema_validator(json.dumps(params, sort_keys=True)).iter_errors(args), key=str)
    except Unresolvable as exc:
        raise ValueError(f"{where} ({name}): the tool's schema has an unresolvable $ref ({str(exc)[:160]})") from None
    except ValueError as exc:
        raise ValueError(f"{where} ({name}): {exc}") from None
    if errors:
        err = errors[0]
        arg = f"argument '{err.path[0]}'" if err.path else "arguments"
        raise ValueError(f"{where} ({name}) {arg}: {err.message}")



def start_row_budget() -> None:
    """Start the regex time budget of one row (``ROW_REGEX_BUDGET_S`` for all its searches)."""
    _row_deadline[0] = time.monotonic() + ROW_REGEX_BUDGET_S


def parse_call(fn: dict[str, Any], where: str, tools: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """``{name, arguments}`` of one call (a row's answer or a conversation's tool call), checked:
    it names an offered tool and its arguments (an object or a JSON string) fit that tool's schema."""
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where} needs a non-empty string 'name'")
    if name not in tools:
        raise ValueError(f"{where} calls undeclared tool '{name}'")
    args = decode_json_field(fn.get("arguments", {}), f"{where}.arguments")
    if not isinstance(args, dict):
        raise ValueError(f"{where} ({name}) 'arguments' must be an object")
    check_arguments(name, args, tools[name]["parameters"], where)
    return {"name": name, "arguments": args}
