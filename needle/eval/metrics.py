"""Score predicted tool calls against the expected ones.

``score_predictions(examples)`` takes one mapping per row with

- ``tools``: the declared tools (list of ``{"name", "parameters", ...}``),
- ``expected``: the reference call list (``[]`` for an off-topic row),
- ``predicted``: the parsed call list, or ``None`` when the output did not parse,

and returns a dict with the keys in :data:`METRIC_KEYS` (always all of them) plus
``per_example``: one flags dict per row, in input order (keys in :data:`FLAG_KEYS`).

Definitions (a rate whose denominator is 0 is ``None``, never NaN):

- ``valid_call_rate``: over all rows, the output parsed, every call names a declared tool and
  its arguments validate against that tool's JSON schema (jsonschema). ``[]`` is valid.
- ``tool_name_accuracy``: over rows that expect calls, the multiset of predicted tool names
  equals the expected one.
- ``exact_match``: over all rows, the call lists are equal as multisets (parallel calls in any
  order; arguments compared by value, so ``1 == 1.0`` but ``True != 1``). Off-topic rows match
  when both are ``[]``.
- ``arg_precision`` / ``arg_recall`` / ``arg_f1``: micro-averaged over ``(tool, key, value)``
  triples of all rows; an unparsed output contributes no predicted triples.
- ``offtopic_accuracy``: over rows expecting ``[]``, the prediction is ``[]``.
- ``offtopic_call_rate``: over rows expecting ``[]``, the prediction is a non-empty call list
  (an unparsed output counts as neither right nor a call).
- ``parse_rate``: over all rows, the output parsed.

Tool ``parameters`` is the JSON schema of the arguments, as ``needle.data.schema.parse_row``
normalises it (xLAM parameter maps already converted). An argument name the schema does not
declare makes a call invalid unless the schema sets ``additionalProperties`` itself.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any

import jsonschema

METRIC_KEYS: tuple[str, ...] = (
    "n",
    "n_with_calls",
    "n_offtopic",
    "parse_rate",
    "valid_call_rate",
    "tool_name_accuracy",
    "exact_match",
    "arg_precision",
    "arg_recall",
    "arg_f1",
    "offtopic_accuracy",
    "offtopic_call_rate",
)
FLAG_KEYS: tuple[str, ...] = (
    "parsed",
    "valid",
    "invalid_reason",
    "exact",
    "tool_ok",
    "offtopic",
    "offtopic_ok",
    "offtopic_called",
    "arg_tp",
    "arg_pred",
    "arg_gold",
)

def canonical(value: Any) -> Any:
    """A hashable, order-free form of a JSON value; numbers compare by value, bools apart."""
    if isinstance(value, bool) or value is None:
        return ("c", value)
    if isinstance(value, (int, float)):
        return ("n", float(value))
    if isinstance(value, str):
        return ("s", value)
    if isinstance(value, (list, tuple)):
        return ("l", tuple(canonical(v) for v in value))
    if isinstance(value, Mapping):
        return ("d", tuple(sorted((str(k), canonical(v)) for k, v in value.items())))
    return ("o", repr(value))


@lru_cache(maxsize=4096)
def _validator(schema_json: str) -> jsonschema.protocols.Validator:
    # Rows repeat the same few tools: build each validator once.
    schema = json.loads(schema_json)
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    cls.check_schema(schema)
    return cls(schema)


def check_calls(calls: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]]) -> str | None:
    """Why ``calls`` are not valid against ``tools`` (unknown tool, bad arguments), or None."""
    by_name = {t.get("name"): t for t in tools}
    for i, call in enumerate(calls):
        tool = by_name.get(call.get("name"))
        if tool is None:
            return f"call {i}: {call.get('name')!r} is not a declared tool"
        schema = tool.get("parameters") or {"type": "object"}
        args = call.get("arguments", {})
        declared = schema.get("properties")
        if isinstance(declared, Mapping) and "additionalProperties" not in schema:
            # A hallucinated argument name would fail a real API even where JSON schema allows it.
            extra = sorted(set(args) - set(declared))
            if extra:
                return f"call {i} ({call['name']}): undeclared argument {extra[0]!r}"
        try:
            validator = _validator(json.dumps(schema, sort_keys=True))
        except (TypeError, ValueError, jsonschema.SchemaError) as exc:
            return f"call {i}: tool {call['name']!r} has an unusable schema: {str(exc).splitlines()[0]}"
        error = jsonschema.exceptions.best_match(validator.iter_errors(args))
        if error is not None:
            where = "/".join(str(p) for p in error.absolute_path) or "arguments"
            return f"call {i} ({call['name']}): {where}: {error.message}"
    return None


def _arg_triples(calls: Sequence[Mapping[str, Any]] | None) -> Counter:
    triples: Counter = Counter()
    for call in calls or []:
        for key, value in (call.get("arguments") or {}).items():
            triples[(call.get("name"), key, canonical(value))] += 1
    return triples


def score_example(
    tools: Sequence[Mapping[str, Any]],
    expected: Sequence[Mapping[str, Any]],
    predicted: Sequence[Mapping[str, Any]] | None,
) -> dict[str, Any]:
    """The per-row flags (see :data:`FLAG_KEYS`); ``tool_ok`` is None on off-topic rows."""
    parsed = predicted is not None
    offtopic = len(expected) == 0
    reason = check_calls(predicted, tools) if parsed else "output did not parse"
    exact = parsed and Counter(canonical(c) for c in predicted) == Counter(canonical(c) for c in expected)
    tool_ok = None
    if not offtopic:
        tool_ok = parsed and Counter(c.get("name") for c in predicted) == Counter(c.get("name") for c in expected)
    gold, pred = _arg_triples(expected), _arg_triples(predicted)
    return {
        "parsed": parsed,
        "valid": reason is None,
        "invalid_reason": reason,
        "exact": bool(exact),
        "tool_ok": tool_ok,
        "offtopic": offtopic,
        "offtopic_ok": offtopic and parsed and len(predicted) == 0,
        "offtopic_called": offtopic and parsed and len(predicted) > 0,
        "arg_tp": sum((gold & pred).values()),
        "arg_pred": sum(pred.values()),
        "arg_gold": sum(gold.values()),
    }


def _rate(hits: int, total: int) -> float | None:
    return hits / total if total else None


def score_predictions(examples: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Aggregate metrics (all :data:`METRIC_KEYS`) plus ``per_example`` flags; see the module doc."""
    flags = [score_example(ex["tools"], ex["expected"], ex["predicted"]) for ex in examples]
    n = len(flags)
    with_calls = [f for f in flags if not f["offtopic"]]
    offtopic = [f for f in flags if f["offtopic"]]
    tp = sum(f["arg_tp"] for f in flags)
    precision = _rate(tp, sum(f["arg_pred"] for f in flags))
    recall = _rate(tp, sum(f["arg_gold"] for f in flags))
    f1 = None
    if precision is not None and recall is not None:
        f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    metrics: dict[str, Any] = {
        "n": n,
        "n_with_calls": len(with_calls),
        "n_offtopic": len(offtopic),
        "parse_rate": _rate(sum(f["parsed"] for f in flags), n),
        "valid_call_rate": _rate(sum(f["valid"] for f in flags), n),
        "tool_name_accuracy": _rate(sum(bool(f["tool_ok"]) for f in with_calls), len(with_calls)),
        "exact_match": _rate(sum(f["exact"] for f in flags), n),
        "arg_precision": precision,
        "arg_recall": recall,
        "arg_f1": f1,
        "offtopic_accuracy": _rate(sum(f["offtopic_ok"] for f in offtopic), len(offtopic)),
        "offtopic_call_rate": _rate(sum(f["offtopic_called"] for f in offtopic), len(offtopic)),
    }
    return {**metrics, "per_example": flags}
