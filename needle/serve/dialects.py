"""Tool schemas in the dialects clients send, as the JSON schema validation and the grammar read.

Function-calling harnesses and client libraries do not all write JSON Schema: Python-minded ones
(a public function-calling benchmark among them) write ``"type": "dict"``, ``"float"``,
``"tuple"`` or ``"any"``, or leave ``type`` out. ``normalise_tools`` rewrites each tool's
``parameters`` before it is validated, rendered into the prompt and compiled into the grammar:

- ``dict`` -> ``object``, ``float`` -> ``number``, ``tuple`` and ``list`` -> ``array``, ``str`` ->
  ``string``, ``int`` -> ``integer``, ``bool`` -> ``boolean`` (any case);
- ``any`` drops the type (no type constraint), as does a type list that holds it;
- a top-level ``parameters`` without ``type`` but with ``properties`` is an ``object``;
- recursively, in ``properties``, ``items``, ``prefixItems``, ``additionalProperties``,
  ``anyOf``/``oneOf``/``allOf``, ``not`` and ``$defs``/``definitions``.

A name outside the table (``"HashMap"``) is left as it is, so validation still refuses it by
name. The input is not modified.

    normalise_tools([{"name": "f", "parameters": {"type": "dict", "properties": {"x": {"type": "float"}}}}])
    # [{"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "number"}}}}]
"""

from __future__ import annotations

from typing import Any

TYPE_NAMES = {"dict": "object", "float": "number", "tuple": "array", "list": "array", "str": "string",
              "int": "integer", "bool": "boolean"}  # fmt: skip
JSON_TYPES = frozenset({"object", "array", "string", "number", "integer", "boolean", "null"})
ANY = "any"
_MAPS = ("properties", "patternProperties", "$defs", "definitions")  # name -> subschema
_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")  # subschema lists
_ONES = ("items", "additionalProperties", "not", "contains")  # a subschema (items may be a list)
# The keywords a top-level ``parameters`` without ``type`` may hold and still be a JSON schema
# (anything else is an xLAM parameter map, which needle.data.schema converts itself).
_OBJECT_KEYWORDS = frozenset({"properties", "required", "additionalProperties", "description", "title",
                              "$defs", "definitions", "$schema"})  # fmt: skip


def _type_name(name: Any) -> Any:
    if not isinstance(name, str):
        return name
    low = name.strip().lower()
    return low if low in JSON_TYPES or low == ANY else TYPE_NAMES.get(low, name)


def normalise_schema(schema: Any) -> Any:
    """``schema`` with the dialects' type names in JSON Schema's (module doc); a copy."""
    if isinstance(schema, list):
        return [normalise_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if "type" in out:
        kind = out["type"]
        names = [_type_name(k) for k in kind] if isinstance(kind, list) else _type_name(kind)
        if names == ANY or (isinstance(names, list) and ANY in names):
            del out["type"]
        else:
            out["type"] = names
    for key in _MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: normalise_schema(sub) for name, sub in out[key].items()}
    for key in (*_LISTS, *_ONES):
        if key in out:
            out[key] = normalise_schema(out[key])
    return out


def _parameters(params: Any) -> Any:
    if not isinstance(params, dict):
        return params
    if "type" not in params and isinstance(params.get("properties"), dict) and set(params) <= _OBJECT_KEYWORDS:
        params = {"type": "object", **params}
    elif "type" not in params:
        return params  # an xLAM parameter map (or an empty one): needle.data.schema reads it
    return normalise_schema(params)


def normalise_tools(tools: Any) -> Any:
    """Each tool's ``parameters`` normalised (module doc), in plain or OpenAI function form; a
    value that is not a list of tools is returned as it is, for validation to refuse."""
    if not isinstance(tools, list):
        return tools
    out = []
    for tool in tools:
        if isinstance(tool, dict) and tool.get("type") == "function" and isinstance(tool.get("function"), dict):
            tool = {**tool, "function": normalise_tools([tool["function"]])[0]}
        elif isinstance(tool, dict) and "parameters" in tool:
            tool = {**tool, "parameters": _parameters(tool["parameters"])}
        out.append(tool)
    return out
