"""The Needle JSONL row format and its validation.

One row is a JSON object::

    {"query": "Turn on the kitchen lights",
     "tools": [{"name": "set_lights", "description": "...",
                "parameters": {"type": "object", "properties": {...}, "required": [...]}}],
     "answers": [{"name": "set_lights", "arguments": {"room": "kitchen", "on": true}}],
     "reasoning": "optional", "system": "optional"}

``answers`` is ``[]`` for an off-topic query. ``tools`` and ``answers`` may also be JSON
*strings* (the xLAM function-calling layout), and xLAM's parameter maps
(``{"city": {"type": "str, optional", ...}}``) are normalised to JSON schema. ``parse_row``
returns a frozen :class:`Row` or raises ``ValueError(reason)``; the loader adds file:line.

Rows are untrusted, so checking one is bounded in time and memory: :func:`loads_bounded`
refuses text over ``MAX_ROW_BYTES``, nesting deeper than ``MAX_DEPTH``, non-finite numbers
(``NaN``, ``Infinity``, ``1e400``) and lone surrogates (``\\ud800``); a tool schema may only
``$ref`` inside itself (nothing is fetched), and ``pattern`` / ``patternProperties`` run on
the ``regex`` engine with a per-match timeout, a timed-out pattern being refused from then on
(needle/data/bounds.py).

A row may instead be a conversation in the OpenAI chat layout, ``{"messages": [...], "tools":
[...]}`` (needle/data/conversation.py): the row then keeps the validated ``messages`` and its
``query``/``answers``/``reasoning`` are those of the last user and assistant turns. Tools may be
given in OpenAI's function form (``{"type": "function", "function": {...}}``) in either layout.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from jsonschema import SchemaError

from needle.data.bounds import (
    MAX_DEPTH, MAX_ROW_BYTES, PATTERN_TIMEOUT_S, ROW_REGEX_BUDGET_S, check_decoded, check_surrogates, decode_json_field, loads_bounded, parse_call, schema_validator, start_row_budget,
)  # fmt: skip
from needle.data.conversation import derived_fields, parse_messages

__all__ = ["MAX_DEPTH", "MAX_ROW_BYTES", "PATTERN_TIMEOUT_S", "ROW_REGEX_BUDGET_S", "Row", "check_decoded",
           "loads_bounded", "parse_row", "row_to_dict", "split_source"]  # fmt: skip



@dataclass(frozen=True)
class Row:
    """A validated tool-calling example; ``source`` is ``file:line`` (or ``hub-id:row``)."""

    query: str
    tools: list[dict[str, Any]]
    answers: list[dict[str, Any]]
    reasoning: str | None
    system: str | None
    source: str
    # A conversation row's validated messages (needle/data/conversation.py's canonical form);
    # None for a query/answers row, which is the two-message conversation user -> assistant.
    messages: list[dict[str, Any]] | None = None


def split_source(source: str) -> tuple[str, int]:
    """``"path/x.jsonl:12"`` -> ``("path/x.jsonl", 12)``; line 0 when there is none."""
    file, _, line = source.rpartition(":")
    if file and line.isdigit():
        return file, int(line)
    return source, 0


# xLAM writes Python-ish type names; anything unknown gets no type constraint.
_XLAM_TYPES = {
    "str": "string", "string": "string", "int": "integer", "integer": "integer",
    "float": "number", "number": "number", "bool": "boolean", "boolean": "boolean",
    "list": "array", "array": "array", "dict": "object", "object": "object",
}  # fmt: skip


def _xlam_to_schema(params: dict[str, Any]) -> dict[str, Any]:
    """Turn an xLAM parameter map into a JSON-schema object."""
    props: dict[str, Any] = {}
    required: list[str] = []
    for name, spec in params.items():
        raw = str(spec.get("type", "")).strip()
        optional = raw.endswith("optional")
        base = raw.split(",")[0].strip().lower()
        base = base.split("[")[0]  # List[int] -> list
        prop: dict[str, Any] = {}
        if base in _XLAM_TYPES:
            prop["type"] = _XLAM_TYPES[base]
        if "description" in spec:
            prop["description"] = spec["description"]
        props[name] = prop
        if not optional and "default" not in spec:
            required.append(name)
    return {"type": "object", "properties": props, "required": required}



def _is_xlam_params(params: dict[str, Any]) -> bool:
    return "type" not in params and all(isinstance(v, dict) for v in params.values())


def _parse_tool(tool: Any, i: int) -> dict[str, Any]:
    where = f"tools[{i}]"
    if not isinstance(tool, dict):
        raise ValueError(f"{where} must be an object, got {type(tool).__name__}")
    if tool.get("type") == "function" and isinstance(tool.get("function"), dict):
        tool = tool["function"]  # OpenAI's function form: {"type": "function", "function": {name, ...}}
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where} needs a non-empty string 'name'")
    desc = tool.get("description")
    if desc is not None and not isinstance(desc, str):
        raise ValueError(f"tool '{name}': 'description' must be a string")
    params = tool.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict):
        raise ValueError(f"tool '{name}': 'parameters' must be an object")
    if _is_xlam_params(params):
        params = _xlam_to_schema(params)
    if params.get("type") != "object":
        raise ValueError(f"tool '{name}': 'parameters' must be a JSON schema with \"type\": \"object\"")
    try:
        schema_validator(json.dumps(params, sort_keys=True))
    except SchemaError as exc:
        raise ValueError(f"tool '{name}': 'parameters' is not a valid JSON schema ({exc.message})") from None
    except ValueError as exc:
        raise ValueError(f"tool '{name}': 'parameters': {exc}") from None
    out: dict[str, Any] = {"name": name}
    if desc is not None:
        out["description"] = desc
    out["parameters"] = params
    return out


def _parse_answer(answer: Any, i: int, tools: dict[str, dict[str, Any]]) -> dict[str, Any]:
    where = f"answers[{i}]"
    if not isinstance(answer, dict):
        raise ValueError(f"{where} must be an object, got {type(answer).__name__}")
    return parse_call(answer, where, tools)


def _optional_str(obj: dict[str, Any], field: str) -> str | None:
    value = obj.get(field)
    if value is not None and not isinstance(value, str):
        raise ValueError(f"'{field}' must be a string, got {type(value).__name__}")
    return value or None


def parse_row(obj: Any, source: str, *, parsed_bounded: bool = False) -> Row:
    """Validate one decoded JSON value and return a normalised :class:`Row`.

    ``parsed_bounded`` says ``obj`` came from :func:`loads_bounded`, which already checked its
    numbers and strings; values decoded elsewhere are checked here. Raises ``ValueError`` with
    a short reason (no location: the caller knows it).
    """
    if not isinstance(obj, dict):
        raise ValueError(f"row must be a JSON object, got {type(obj).__name__}")
    start_row_budget()
    # A null column (a hub dataset or a prepared record mixing both layouts) counts as absent.
    present = {k for k, v in obj.items() if v is not None}
    conversation = "messages" in present
    if conversation and present & {"query", "answers"}:
        raise ValueError("a row has either 'messages' (a conversation) or 'query' and 'answers', not both")
    for field in ("tools",) if conversation else ("query", "tools", "answers"):
        if field not in present:
            raise ValueError(f"missing field '{field}'")
    tools, by_name = _parse_tools(obj["tools"], parsed_bounded)
    if conversation:
        messages = parse_messages(obj["messages"], by_name, parsed_bounded)
        query, answers, reasoning, system = derived_fields(messages)
        return Row(query=query, tools=tools, answers=answers, reasoning=reasoning, system=system, source=source,
                   messages=messages)  # fmt: skip
    query = obj["query"]
    if not isinstance(query, str) or not query.strip():
        raise ValueError("'query' must be a non-empty string")
    if not parsed_bounded:
        check_surrogates(query)  # a decoded row (hub, Python caller) was never checked by a parser
    raw_answers = decode_json_field(obj["answers"], "answers", parsed_bounded)
    if not isinstance(raw_answers, list):
        raise ValueError(f"'answers' must be a list, got {type(raw_answers).__name__}")
    answers = [_parse_answer(a, i, by_name) for i, a in enumerate(raw_answers)]
    return Row(
        query=query,
        tools=tools,
        answers=answers,
        reasoning=_optional_str(obj, "reasoning"),
        system=_optional_str(obj, "system"),
        source=source,
    )


def _parse_tools(value: Any, parsed_bounded: bool) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    raw_tools = decode_json_field(value, "tools", parsed_bounded)
    if not isinstance(raw_tools, list):
        raise ValueError(f"'tools' must be a list, got {type(raw_tools).__name__}")
    tools = [_parse_tool(t, i) for i, t in enumerate(raw_tools)]
    by_name: dict[str, dict[str, Any]] = {}
    for tool in tools:
        if tool["name"] in by_name:
            raise ValueError(f"tool name '{tool['name']}' is declared twice")
        by_name[tool["name"]] = tool
    return tools, by_name


def row_to_dict(row: Row) -> dict[str, Any]:
    """The JSON-ready form of a row (source excluded), in the canonical key order."""
    if row.messages is not None:
        return {"messages": row.messages, "tools": row.tools}
    out: dict[str, Any] = {"query": row.query, "tools": row.tools, "answers": row.answers}
    if row.reasoning is not None:
        out["reasoning"] = row.reasoning
    if row.system is not None:
        out["system"] = row.system
    return out
