"""Rows shared by the data tests (imported as ``data_helpers``: pytest puts tests/data on the path)."""

from __future__ import annotations

from typing import Any

TIMER = {
    "name": "set_timer",
    "description": "Start a timer",
    "parameters": {
        "type": "object",
        "properties": {"minutes": {"type": "integer"}, "label": {"type": "string"}},
        "required": ["minutes"],
    },
}
LIGHTS = {
    "name": "set_lights",
    "parameters": {"type": "object", "properties": {"room": {"type": "string"}, "on": {"type": "boolean"}}},
}


def good_row(**overrides: Any) -> dict[str, Any]:
    """A valid row; keyword arguments replace (or, with value ..., delete) fields."""
    row: dict[str, Any] = {
        "query": "Set a timer for 5 minutes",
        "tools": [TIMER, LIGHTS],
        "answers": [{"name": "set_timer", "arguments": {"minutes": 5}}],
    }
    for key, value in overrides.items():
        if value is ...:
            row.pop(key)
        else:
            row[key] = value
    return row
