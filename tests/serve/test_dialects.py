"""Tool schemas in the dialects clients send ("dict", "float", "tuple", "any", no type) are
normalised, not refused: unit cases, and a served model answering a call to such a tool."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from needle.serve.dialects import normalise_schema, normalise_tools
from needle.serve.engine import checked_tools

# As a public function-calling benchmark writes its Python functions' schemas.
AREA = {"name": "triangle_area", "description": "Area of a triangle",
        "parameters": {"type": "dict", "required": ["base", "height"], "properties": {
            "base": {"type": "float", "description": "base length"},
            "height": {"type": "integer"},
            "corners": {"type": "tuple", "items": {"type": "float"}},
            "unit": {"type": "any", "description": "any unit"},
            "style": {"type": "dict", "properties": {"color": {"type": "str"}}},
            "note": {"description": "no type at all"}}}}  # fmt: skip
PING = {"name": "ping", "parameters": {"properties": {"host": {"type": "String"}}, "required": ["host"]}}


def test_dialect_types_become_json_schema_types_recursively() -> None:
    (area,) = normalise_tools([AREA])
    params = area["parameters"]
    assert params["type"] == "object" and params["required"] == ["base", "height"]
    props = params["properties"]
    assert props["base"] == {"type": "number", "description": "base length"}
    assert props["corners"] == {"type": "array", "items": {"type": "number"}}
    assert props["unit"] == {"description": "any unit"}  # "any": no type constraint
    assert props["style"] == {"type": "object", "properties": {"color": {"type": "string"}}}
    assert props["note"] == {"description": "no type at all"}
    assert AREA["parameters"]["type"] == "dict"  # the input is not modified
    assert normalise_tools([PING])[0]["parameters"]["type"] == "object"  # parameters without type
    assert normalise_schema({"type": ["float", "null"]}) == {"type": ["number", "null"]}
    assert normalise_schema({"type": ["any", "string"]}) == {}
    assert normalise_schema({"anyOf": [{"type": "dict"}, {"type": "tuple"}], "not": {"type": "float"}}) == \
        {"anyOf": [{"type": "object"}, {"type": "array"}], "not": {"type": "number"}}  # fmt: skip
    wrapped = normalise_tools([{"type": "function", "function": AREA}])[0]
    assert wrapped["function"] == area
    # An xLAM parameter map is left to needle.data.schema, which converts it itself.
    xlam = {"name": "f", "parameters": {"city": {"type": "str, optional", "description": "c"}}}
    assert normalise_tools([xlam]) == [xlam]


def test_dialect_tools_pass_validation_and_unknown_names_are_still_refused() -> None:
    checked = checked_tools([AREA, PING])
    assert [t["parameters"]["type"] for t in checked] == ["object", "object"]
    with pytest.raises(ValueError, match="triangle_area"):
        checked_tools([{**AREA, "parameters": {"type": "dict", "properties": {"x": {"type": "HashMap"}}}}])


def test_a_served_model_calls_a_dialect_tool(tiny_model_dir: Path) -> None:
    from needle.model.io import load_model
    from needle.serve.engine import Predictor
    from needle.serve.requests import answer

    predictor = Predictor(load_model(tiny_model_dir))
    body = {"messages": [{"role": "user", "content": "ping example.org"}], "tool_choice": "required",
            "tools": [{"type": "function", "function": t} for t in (AREA, PING)]}  # fmt: skip
    out = answer(predictor, body, {})
    assert "error" not in out, out  # before: "'parameters' must be a JSON schema with "type": "object""
    choice = out["choices"][0]
    assert choice["finish_reason"] in ("tool_calls", "length") and out["usage"]["completion_tokens"] > 0
    schemas = {t["name"]: t["parameters"] for t in normalise_tools([AREA, PING])}
    for call in choice["message"].get("tool_calls") or []:  # constrained under the normalised schema
        jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[call["function"]["name"]])
