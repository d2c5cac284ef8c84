"""score_predictions on hand-made rows: each metric's numerator and denominator."""

from __future__ import annotations

import pytest

from needle.eval.metrics import FLAG_KEYS, METRIC_KEYS, check_calls, score_predictions

def tool(name: str, required: list[str], **types: str) -> dict:
    props = {arg: {"type": t} for arg, t in types.items()}
    return {"name": name, "parameters": {"type": "object", "properties": props, "required": required}}


WEATHER = tool("get_weather", ["city"], city="string", days="integer")
CONVERT = tool("convert", ["amount", "to"], amount="number", to="string")
TOOLS = [WEATHER, CONVERT]


def call(name: str, **args: object) -> dict:
    return {"name": name, "arguments": args}


def row(expected: list, predicted: list | None) -> dict:
    return {"tools": TOOLS, "expected": expected, "predicted": predicted}


def test_exact_match_counts_every_metric_as_perfect() -> None:
    gold = [call("get_weather", city="Paris", days=2)]
    out = score_predictions([row(gold, [call("get_weather", days=2.0, city="Paris")])])
    assert set(METRIC_KEYS) <= set(out) and set(out["per_example"][0]) == set(FLAG_KEYS)
    assert out["exact_match"] == 1.0 and out["valid_call_rate"] == 1.0 and out["tool_name_accuracy"] == 1.0
    assert out["arg_precision"] == out["arg_recall"] == out["arg_f1"] == 1.0
    assert out["offtopic_accuracy"] is None and out["offtopic_call_rate"] is None


def test_partial_arguments_give_partial_precision_and_recall() -> None:
    gold = [call("get_weather", city="Paris", days=3)]
    pred = [call("get_weather", city="Paris", days=4)]
    out = score_predictions([row(gold, pred)])
    assert out["exact_match"] == 0.0 and out["tool_name_accuracy"] == 1.0
    assert out["arg_precision"] == 0.5 and out["arg_recall"] == 0.5 and out["arg_f1"] == 0.5
    # a missing argument: precision stays 1, recall halves
    out = score_predictions([row(gold, [call("get_weather", city="Paris")])])
    assert out["arg_precision"] == 1.0 and out["arg_recall"] == 0.5
    assert out["arg_f1"] == pytest.approx(2 / 3)


def test_wrong_tool_and_undeclared_tool() -> None:
    gold = [call("get_weather", city="Paris")]
    out = score_predictions([row(gold, [call("convert", amount=1, to="EUR")]), row(gold, [call("launch", x=1)])])
    assert out["tool_name_accuracy"] == 0.0 and out["exact_match"] == 0.0 and out["arg_precision"] == 0.0
    assert out["valid_call_rate"] == 0.5
    assert "not a declared tool" in out["per_example"][1]["invalid_reason"]


def test_schema_violations_make_a_call_invalid() -> None:
    assert check_calls([call("get_weather", city=3)], TOOLS)  # wrong type
    assert check_calls([call("get_weather", days=2)], TOOLS)  # missing required
    assert check_calls([call("get_weather", city="x", zone="y")], TOOLS)  # undeclared argument
    assert check_calls([call("get_weather", city="x", days=True)], TOOLS)  # bool is not int
    assert check_calls([call("convert", amount="1", to="EUR")], TOOLS)  # JSON schema type
    assert check_calls([call("convert", amount=1, to="EUR"), call("get_weather", city="x")], TOOLS) is None


def test_invalid_json_counts_as_unparsed_everywhere() -> None:
    gold = [call("get_weather", city="Paris")]
    out = score_predictions([row(gold, None), row(gold, gold)])
    assert out["parse_rate"] == 0.5 and out["valid_call_rate"] == 0.5 and out["exact_match"] == 0.5
    assert out["arg_precision"] == 1.0 and out["arg_recall"] == 0.5
    flags = out["per_example"][0]
    assert flags["parsed"] is False and flags["tool_ok"] is False and flags["arg_gold"] == 1


def test_parallel_calls_in_another_order_match() -> None:
    gold = [call("get_weather", city="Paris"), call("get_weather", city="Oslo"), call("convert", amount=5, to="USD")]
    pred = [gold[2], gold[1], gold[0]]
    out = score_predictions([row(gold, pred)])
    assert out["exact_match"] == 1.0 and out["arg_f1"] == 1.0
    # a duplicated call is not the same multiset
    out = score_predictions([row(gold, [gold[0], gold[0], gold[2]])])
    assert out["exact_match"] == 0.0 and out["tool_name_accuracy"] == 1.0 and out["arg_recall"] == pytest.approx(3 / 4)


def test_offtopic_right_wrong_and_malformed() -> None:
    out = score_predictions([row([], []), row([], [call("get_weather", city="Paris")]), row([], None)])
    assert out["n_offtopic"] == 3 and out["n_with_calls"] == 0
    assert out["offtopic_accuracy"] == pytest.approx(1 / 3)
    assert out["offtopic_call_rate"] == pytest.approx(1 / 3)
    assert out["exact_match"] == pytest.approx(1 / 3)
    assert out["tool_name_accuracy"] is None
    # no argument triples at all: precision/recall undefined, not NaN
    assert out["arg_precision"] == 0.0 and out["arg_recall"] is None and out["arg_f1"] is None


def test_empty_input_gives_none_rates() -> None:
    out = score_predictions([])
    assert out["n"] == 0 and out["per_example"] == []
    assert all(out[k] is None for k in METRIC_KEYS if not k.startswith("n"))
