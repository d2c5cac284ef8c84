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
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from jsonschema import SchemaError
from jsonschema.validators import validator_for


@dataclass(frozen=True)
class Row:
    """A validated tool-calling example; ``source`` is ``file:line`` (or ``hub-id:row``)."""

    query: str
    tools: list[dict[str, Any]]
    answers: list[dict[str, Any]]
    reasoning: str | None
    system: str | None
    source: str


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


def _decode_json_field(value: Any, field: str) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"'{field}' is a string but not valid JSON ({exc.msg})") from None
    return value


def _is_xlam_params(params: dict[str, Any]) -> bool:
    return "type" not in params and all(isinstance(v, dict) for v in params.values())


def _parse_tool(tool: Any, i: int) -> dict[str, Any]:
    where = f"tools[{i}]"
    if not isinstance(tool, dict):
        raise ValueError(f"{where} must be an object, got {type(tool).__name__}")
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
        _validator(json.dumps(params, sort_keys=True))
    except SchemaError as exc:
        raise ValueError(f"tool '{name}': 'parameters' is not a valid JSON schema ({exc.message})") from None
    out: dict[str, Any] = {"name": name}
    if desc is not None:
        out["description"] = desc
    out["parameters"] = params
    return out


@lru_cache(maxsize=4096)
def _validator(schema_json: str) -> Any:
    # Rows repeat the same few tool schemas thousands of times: build each validator once.
    schema = json.loads(schema_json)
    cls = validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def _check_arguments(name: str, args: dict[str, Any], params: dict[str, Any], where: str) -> None:
    props = params.get("properties", {})
    for req in params.get("required", []):
        if req not in args:
            raise ValueError(f"{where} ({name}) is missing required argument '{req}'")
    if params.get("additionalProperties") is False:
        extra = sorted(set(args) - set(props))
        if extra:
            raise ValueError(f"{where} ({name}) has undeclared argument '{extra[0]}'")
    errors = sorted(_validator(json.dumps(params, sort_keys=True)).iter_errors(args), key=str)
    if errors:
        err = errors[0]
        arg = f"argument '{err.path[0]}'" if err.path else "arguments"
        raise ValueError(f"{where} ({name}) {arg}: {err.message}")


def _parse_answer(answer: Any, i: int, tools: dict[str, dict[str, Any]]) -> dict[str, Any]:
    where = f"answers[{i}]"
    if not isinstance(answer, dict):
        raise ValueError(f"{where} must be an object, got {type(answer).__name__}")
    name = answer.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where} needs a non-empty string 'name'")
    if name not in tools:
        raise ValueError(f"{where} calls undeclared tool '{name}'")
    args = _decode_json_field(answer.get("arguments", {}), f"{where}.arguments")
    if not isinstance(args, dict):
        raise ValueError(f"{where} ({name}) 'arguments' must be an object")
    _check_arguments(name, args, tools[name]["parameters"], where)
    return {"name": name, "arguments": args}


def _optional_str(obj: dict[str, Any], field: str) -> str | None:
    value = obj.get(field)
    if value is not None and not isinstance(value, str):
        raise ValueError(f"'{field}' must be a string, got {type(value).__name__}")
    return value or None


def parse_row(obj: Any, source: str) -> Row:
    """Validate one decoded JSON value and return a normalised :class:`Row`.

    Raises ``ValueError`` with a short reason (no location: the caller knows it).
    """
    if not isinstance(obj, dict):
        raise ValueError(f"row must be a JSON object, got {type(obj).__name__}")
    for field in ("query", "tools", "answers"):
        if field not in obj:
            raise ValueError(f"missing field '{field}'")
    query = obj["query"]
    if not isinstance(query, str) or not query.strip():
        raise ValueError("'query' must be a non-empty string")
    raw_tools = _decode_json_field(obj["tools"], "tools")
    if not isinstance(raw_tools, list):
        raise ValueError(f"'tools' must be a list, got {type(raw_tools).__name__}")
    tools = [_parse_tool(t, i) for i, t in enumerate(raw_tools)]
    by_name: dict[str, dict[str, Any]] = {}
    for tool in tools:
        if tool["name"] in by_name:
            raise ValueError(f"tool name '{tool['name']}' is declared twice")
        by_name[tool["name"]] = tool
    raw_answers = _decode_json_field(obj["answers"], "answers")
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


def row_to_dict(row: Row) -> dict[str, Any]:
    """The JSON-ready form of a row (source excluded), in the canonical key order."""
    out: dict[str, Any] = {"query": row.query, "tools": row.tools, "answers": row.answers}
    if row.reasoning is not None:
        out["reasoning"] = row.reasoning
    if row.system is not None:
        out["system"] = row.system
    return out
