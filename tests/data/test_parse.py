"""parse_calls: well-formed turns, reasoning, and every kind of malformed output."""

from __future__ import annotations

import pytest

from needle.data.parse import parse_calls

CALL = '{"name":"get_weather","arguments":{"city":"Paris"}}'


def test_parses_single_call_with_and_without_end() -> None:
    for text in (f"<|call|>[{CALL}]", f"<|call|>[{CALL}]<|end|>", f"  <|call|> [{CALL}] \n"):
        out = parse_calls(text)
        assert out.ok and out.error is None
        assert out.calls == [{"name": "get_weather", "arguments": {"city": "Paris"}}]
        assert out.reasoning is None


def test_parses_reasoning_and_parallel_calls() -> None:
    out = parse_calls(f'<|think|>two cities <|call|>[{CALL},{{"name":"get_weather","arguments":{{"city":"Oslo"}}}}]')
    assert out.reasoning == "two cities"
    assert [c["arguments"]["city"] for c in out.calls] == ["Paris", "Oslo"]


def test_empty_list_is_a_valid_offtopic_answer() -> None:
    out = parse_calls("<|call|>[]")
    assert out.calls == [] and out.error is None


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("I cannot help with that.", "missing"),
        ("sure <|call|>[]", "preceded"),
        ("<|think|>hmm, let me see", "no <|call|> after the reasoning"),
        ("<|call|>", "nothing after"),
        ('<|call|>[{"name":"f","arguments":{"x":1}', "invalid JSON"),
        ('<|call|>[{"name":"f","arguments":{}}] trailing', "text after the JSON"),
        ('<|call|>{"name":"f","arguments":{}}', "not a list"),
        ('<|call|>["f"]', "not an object"),
        ('<|call|>[{"arguments":{}}]', "no string 'name'"),
        ('<|call|>[{"name":"f"}]', "no 'arguments'"),
        ('<|call|>[{"name":"f","arguments":[1]}]', "not an object"),
        ('<|call|>[{"name":"f","arguments":{},"id":3}]', "unexpected keys"),
        ("<|call|>[]<|call|>[]", "special token"),
    ],
)
def test_malformed_outputs_give_an_error_not_an_exception(text: str, fragment: str) -> None:
    out = parse_calls(text)
    assert out.calls is None and not out.ok
    assert fragment in out.error


def test_reasoning_kept_even_when_call_is_broken() -> None:
    out = parse_calls("<|think|>plan<|call|>[oops")
    assert out.calls is None and out.reasoning == "plan"


def test_non_string_input_does_not_raise() -> None:
    assert parse_calls(None).error.startswith("expected text")  # type: ignore[arg-type]
