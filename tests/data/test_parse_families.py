"""Tool-call parsers of pretrained models' templates, on hand-made outputs, and parser_for."""

from __future__ import annotations

import pytest

from needle.data.parse import (
    parse_calls,
    parse_function_gemma,
    parse_hermes,
    parse_json_list,
    parse_llama_json,
    parser_for,
)

F = {"name": "f", "arguments": {"x": 1, "s": "a, b"}}
G = {"name": "g", "arguments": {}}


@pytest.mark.parametrize(
    ("text", "calls", "reasoning"),
    [
        ('<tool_call>\n{"name": "f", "arguments": {"x": 1, "s": "a, b"}}\n</tool_call>', [F], None),
        ('<think>\n\n</think>\n\n<tool_call>\n{"name": "f", "arguments": {"x": 1, "s": "a, b"}}\n</tool_call>\n'
         '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>', [F, G], None),
        ('<think>\nuse f\n</think>\n\n<tool_call>{"name": "g", "arguments": "{}"}</tool_call>', [G], "use f"),
        ("<think>\n\n</think>\n\n", [], None),
        ("I cannot help with that.", [], None),
    ],
)  # fmt: skip
def test_hermes(text: str, calls: list, reasoning: str | None) -> None:
    got = parse_hermes(text)
    assert got.ok and got.calls == calls and got.reasoning == reasoning


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ('<tool_call>\n{"name": "f", "arguments": {"x": 1}', "unbalanced"),
        ('<tool_call>{"name": "f", "arguments": {"x": 1}</tool_call>', "call 0: invalid JSON"),
        ('<tool_call>{"name": "f"}</tool_call>', "has no 'arguments'"),
        ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', "not an object"),
        ('<tool_call>{"name": "f", "arguments": {}, "id": 3}</tool_call>', "unexpected keys"),
        ("<tool_call>[]</tool_call>", "not an object"),
    ],
)
def test_hermes_errors(text: str, error: str) -> None:
    got = parse_hermes(text)
    assert got.calls is None and error in got.error


@pytest.mark.parametrize(
    ("text", "calls"),
    [
        ('{"name": "f", "parameters": {"x": 1, "s": "a, b"}}', [F]),
        ('<|python_tag|>{"name": "f", "parameters": {"x": 1, "s": "a, b"}}<|eom_id|>', [F]),
        ('{"name": "f", "parameters": {"x": 1, "s": "a, b"}}\n{"name": "g", "parameters": {}}', [F, G]),
        ('{"name": "f", "parameters": {"x": 1, "s": "a, b"}}; {"name": "g", "arguments": {}}', [F, G]),
        ('[{"name": "f", "parameters": {"x": 1, "s": "a, b"}}, {"name": "g", "parameters": {}}]', [F, G]),
        ("", []),
        ("The weather is nice today.", []),
    ],
)
def test_llama_json(text: str, calls: list) -> None:
    got = parse_llama_json(text)
    assert got.ok and got.calls == calls


def test_llama_json_errors() -> None:
    assert "invalid JSON" in parse_llama_json('{"name": "f", "parameters": {"x": 1}').error
    assert "no string 'name'" in parse_llama_json('{"parameters": {}}').error
    assert "not an object" in parse_llama_json("[1]").error


def test_function_gemma() -> None:
    text = (
        "<start_function_call>call:f{x:1,s:<escape>a, b<escape>}<end_function_call>"
        "<start_function_call>call:g{}<end_function_call>"
    )
    assert parse_function_gemma(text).calls == [F, G]
    nested = "<start_function_call>call:h{a:[1,<escape>x<escape>],b:{c:true,d:null},e:-2.5}<end_function_call>"
    assert parse_function_gemma(nested).calls == [
        {"name": "h", "arguments": {"a": [1, "x"], "b": {"c": True, "d": None}, "e": -2.5}}
    ]
    assert parse_function_gemma("No tool fits.").calls == []
    assert "unbalanced" in parse_function_gemma("<start_function_call>call:f{x:1}").error
    assert "malformed" in parse_function_gemma("<start_function_call>call:f{x:<escape>1}<end_function_call>").error


def test_json_list() -> None:
    assert parse_json_list('[{"name":"f","arguments":{"x":1,"s":"a, b"}}]').calls == [F]
    assert parse_json_list('```json\n[{"name":"g","arguments":{}}]\n```').calls == [G]
    assert parse_json_list("[]").calls == []
    assert "no call list" in parse_json_list("  ").error
    assert "text after the JSON" in parse_json_list("[] and more").error
    assert "not a list" in parse_json_list('{"name":"g","arguments":{}}').error


def test_parser_for_detects_the_family_from_the_template() -> None:
    assert parser_for(None) is parse_calls
    assert parser_for("…<tool_call>\\n{\"name\": …") is parse_hermes
    assert parser_for("{{- '{\"name\": \"' + tool_call.name + '\", \"parameters\": ' }}") is parse_llama_json
    assert parser_for("<start_function_call>call:{{ name }}") is parse_function_gemma
    assert parser_for("{{ message.content }}") is parse_json_list
