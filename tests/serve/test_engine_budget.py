"""The answer's budget when a prompt leaves less than max_new_tokens (96) of the context: without
an explicit budget the row is answered in what is left; only a prompt that does not fit the
context is refused; a caller that sets max_new_tokens gets its budget whole or a refusal."""

from __future__ import annotations

from pathlib import Path

import pytest

from needle.config import EvalConfig
from needle.data.render import encode_prompts
from needle.data.schema import Row
from needle.serve.engine import Predictor
from needle.serve.prompt import Request


TOOLS = [{"name": "ping", "description": "ping", "parameters": {"type": "object", "properties": {}}}]


@pytest.fixture(scope="module")
def predictor(tiny_model_dir: Path) -> Predictor:
    from needle.model.io import load_model

    return Predictor(load_model(tiny_model_dir))


def _query_of(p: Predictor, at_least: int) -> tuple[str, int]:
    """A query whose prompt (with TOOLS) has at least ``at_least`` tokens, and its length."""
    n = 1
    while True:
        query = "remind me " + "please " * n
        row = Row(query=query, tools=TOOLS, answers=[], reasoning=None, system=None, source="t")
        length = len(encode_prompts(p.fmt, [row], p.tok)[0])
        if length >= at_least:
            return query, length
        n += max(1, (at_least - length) // 8)  # a word is a few tokens: no overshoot past max_len - 1


def test_a_prompt_leaving_less_than_the_budget_is_answered_in_what_is_left(predictor: Predictor) -> None:
    max_len, budget = predictor.model.cfg.max_len, predictor.cfg.max_new_tokens
    query, length = _query_of(predictor, max_len - budget + 20)
    assert max_len - budget < length < max_len - 1  # leaves room, but less than 96
    (text,) = predictor.predict([Request(query=query, tools=TOOLS, mode="none")], constrained=True)
    assert "error" not in text and isinstance(text["content"], str), text
    (calls,) = predictor.predict([(query, TOOLS)], constrained=True)
    assert "tokens; at most" not in str(calls)  # decoded (a call list, or a reply cut short), not refused
    assert predictor._limit([0] * length) == max_len - length


def test_only_a_prompt_that_does_not_fit_the_context_is_refused(predictor: Predictor) -> None:
    max_len = predictor.model.cfg.max_len
    query, length = _query_of(predictor, max_len)
    (out,) = predictor.predict([(query, TOOLS)], constrained=True)
    assert out == {"error": f"prompt has {length} tokens; at most {max_len - 1} fit in the model's context of "
                            f"{max_len}", "raw": ""}  # fmt: skip


def test_an_explicit_budget_is_kept_whole(predictor: Predictor) -> None:
    strict = Predictor(predictor.loaded, EvalConfig(max_new_tokens=96))
    max_len = strict.model.cfg.max_len
    query, length = _query_of(strict, max_len - 96 + 20)
    (out,) = strict.predict([(query, TOOLS)], constrained=True)
    assert out == {"error": f"prompt has {length} tokens; at most {max_len - 96} fit with max_new_tokens=96",
                   "raw": ""}  # fmt: skip
