"""Per-turn evaluation of conversations (issue 21, item 3): each assistant turn continues from the
true history, calling turns are scored as calls, text turns by answers_in_text and ROUGE-L, and
whole conversations by conversation_exact_match; query/answers rows score as before.

    JAX_PLATFORMS=cpu .venv/bin/python -m pytest -q tests/eval/test_evaluate_turns.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

import needle.eval.evaluate as evaluate_mod
from needle.config import EvalConfig
from needle.data.chat import format_for
from needle.data.schema import Row, parse_row
from needle.data.turns import conversation_prompt, expand_turns
from needle.eval.turn_metrics import rouge_l, score_conversations
from needle.model.io import load_model
from tests.eval.test_evaluate import ScriptedDecoder

WEATHER = {"name": "get_weather", "description": "Current weather",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}  # fmt: skip


def _call(cid: str, city: str) -> dict[str, Any]:
    return {"id": cid, "type": "function", "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}


def _conversation(source: str, city: str, answer: str) -> Row:
    messages = [
        {"role": "user", "content": f"Weather in {city}?"},
        {"role": "assistant", "content": None, "tool_calls": [_call("c1", city)]},
        {"role": "tool", "tool_call_id": "c1", "content": json.dumps({"temp": 3, "city": city})},
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "And in Bergen?"},
        {"role": "assistant", "content": None, "tool_calls": [_call("c2", "Bergen")]},
    ]
    return parse_row({"messages": messages, "tools": [WEATHER]}, source)


def _oracle(fmt: Any, tok: Any, row: Row) -> str:
    """The text of the row's last assistant turn as its format encodes it (what a perfect model emits)."""
    ex = fmt.encode_conversation(row, tok, sys.maxsize, loss_on="last_assistant")
    ids = [i for i, m in zip(ex.ids, ex.loss_mask) if m]
    return tok.decode(ids[:-1] if ids[-1:] == [tok.end_id] else ids)


def test_expand_turns_gives_each_assistant_turn_its_true_history(eval_rows: list[Row]) -> None:
    conv = _conversation("c.jsonl:1", "Oslo", "It is 3 degrees in Oslo.")
    turns = expand_turns([eval_rows[0], conv])
    assert [(t.conversation, t.message, t.kind) for t in turns] == [
        (0, 1, turns[0].kind), (1, 1, "calls"), (1, 3, "text"), (1, 5, "calls")]  # fmt: skip
    assert turns[0].row is eval_rows[0]
    text = turns[2]
    assert text.text == "It is 3 degrees in Oslo." and text.row.answers == [] and len(text.row.messages) == 4
    assert text.row.messages[-2]["role"] == "tool" and turns[3].row.query == "And in Bergen?"
    assert turns[3].row.answers == [{"name": "get_weather", "arguments": {"city": "Bergen"}}]


def test_rouge_l_and_conversation_exact() -> None:
    assert rouge_l("It is 3 degrees.", "it is 3 degrees") == 1.0
    assert rouge_l("4 C in Oslo", "It is 4 C in Oslo.") == pytest.approx(0.8)
    assert rouge_l("sunny", "It is 4 C in Oslo.") == 0.0 and rouge_l("", "") == 1.0
    assert score_conversations([(0, True), (0, False), (1, True)]) == {
        "n_conversations": 2, "conversation_exact_match": 0.5}  # fmt: skip


def _scripted(monkeypatch: pytest.MonkeyPatch, loaded: Any, rows: list[Row], answer: Any) -> ScriptedDecoder:
    """Answers every turn of ``rows`` with ``answer(turn, oracle_text)``, keyed by the turn's prompt."""
    tok, fmt = loaded.tokenizer, format_for(loaded.tokenizer)
    script = {tuple(conversation_prompt(fmt, t.row, tok)): answer(t, _oracle(fmt, tok, t.row)) for t in expand_turns(rows)}
    fake = ScriptedDecoder(tok, script)
    monkeypatch.setattr(evaluate_mod, "generate_detailed", fake)
    return fake


def test_a_perfect_agent_scores_every_turn(monkeypatch, tiny_model_dir: Path) -> None:
    loaded = load_model(tiny_model_dir)
    rows = [_conversation("c.jsonl:1", "Oslo", "It is 3 degrees in Oslo."),
            _conversation("c.jsonl:2", "Rome", "Rome has 3 degrees.")]  # fmt: skip
    fake = _scripted(monkeypatch, loaded, rows, lambda t, oracle: oracle)
    result = evaluate_mod.evaluate_model(loaded, rows, EvalConfig(max_new_tokens=64, constrained=False))
    m = result.metrics
    assert (m["n_turns"], m["n"], m["n_text_turns"], m["n_conversations"]) == (6, 4, 2, 2)
    assert m["exact_match"] == 1.0 and m["answers_in_text"] == 1.0 and m["text_rouge_l"] == 1.0
    assert m["conversation_exact_match"] == 1.0
    # The text turn's prompt holds the tool's result: the model continues from the true history.
    seen = loaded.tokenizer.decode(fake.seen[1])
    assert "temp" in seen and seen.index("temp") > seen.index('"Oslo"}}]') and "degrees" not in seen
    assert [ex["turn"] for ex in result.examples] == [1, 3, 5, 1, 3, 5]
    assert result.examples[1]["expected"] == result.examples[1]["predicted"] == "It is 3 degrees in Oslo."


def test_an_agent_that_calls_again_after_the_result_is_caught(monkeypatch, tiny_model_dir: Path) -> None:
    loaded = load_model(tiny_model_dir)
    rows = [_conversation("c.jsonl:1", "Oslo", "It is 3 degrees in Oslo.")]
    first_call = {}

    def answer(t: Any, oracle: str) -> str:
        first_call.setdefault("text", oracle)  # the first turn's call, repeated on every later turn
        return first_call["text"] if t.kind == "text" else oracle

    _scripted(monkeypatch, loaded, rows, answer)
    m = evaluate_mod.evaluate_model(loaded, rows, EvalConfig(max_new_tokens=64, constrained=False)).metrics
    assert m["exact_match"] == 1.0  # both calling turns are right ...
    assert m["answers_in_text"] == 0.0 and m["text_rouge_l"] == 0.0  # ... but it never answers in words
    assert m["conversation_exact_match"] == 0.0


def test_single_turn_rows_report_no_turn_metrics(monkeypatch, tiny_model_dir: Path, eval_rows: list[Row]) -> None:
    loaded = load_model(tiny_model_dir)
    from tests.eval.test_evaluate import _script
    from needle.data.render import render_target

    rows = eval_rows[:3]
    _script(monkeypatch, loaded.tokenizer, rows, [render_target(r).removesuffix("<|end|>") for r in rows])
    result = evaluate_mod.evaluate_model(loaded, rows, EvalConfig(max_new_tokens=64, constrained=False))
    assert result.metrics["exact_match"] == 1.0 and result.metrics["n"] == 3
    assert not {"n_turns", "answers_in_text", "conversation_exact_match"} & set(result.metrics)
    assert all("turn" not in ex for ex in result.examples)


def test_a_real_decode_of_conversations_free_and_constrained(tiny_model_dir: Path) -> None:
    rows = [_conversation("c.jsonl:1", "Oslo", "It is 3 degrees in Oslo.")]
    result = evaluate_mod.evaluate_model(tiny_model_dir, rows, EvalConfig(max_new_tokens=8, batch_size=4))
    m = result.metrics
    assert m["n_turns"] == 3 and m["n_text_turns"] == 1 and m["n_conversations"] == 1
    for prefix in ("", "constrained_"):
        assert 0.0 <= m[f"{prefix}answers_in_text"] <= 1.0 and 0.0 <= m[f"{prefix}text_rouge_l"] <= 1.0
        assert m[f"{prefix}conversation_exact_match"] in (0.0, 1.0)
    assert "constrained_n_turns" not in m and [ex["turn"] for ex in result.constrained_examples] == [1, 3, 5]
