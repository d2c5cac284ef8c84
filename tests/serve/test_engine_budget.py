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


MESSAGES = [{"role": "user", "content": "remind me to ping the server"}]


def test_a_requests_max_tokens_is_its_budget_capped_by_the_context(predictor: Predictor) -> None:
    from needle.data.turns import conversation_prompt
    from needle.serve.prompt import conversation_row

    prompt = len(conversation_prompt(predictor.fmt, conversation_row(MESSAGES, TOOLS), predictor.tok))
    max_len = predictor.model.cfg.max_len
    # A call list cut by a 2-token budget: unreadable, and cut (a 200 "length" reply in chat).
    (cut,) = predictor.predict_detailed([Request(messages=MESSAGES, tools=TOOLS, mode="required", max_tokens=2)])
    assert cut.cut and "within 2 tokens" in cut.prediction["error"], cut
    assert (cut.prompt_tokens, cut.completion_tokens) == (prompt, 2)
    # Budgets of one call may differ (decoded in separate batches); a budget past the context is
    # capped by what the prompt leaves, not refused. The random model's text runs to its budget.
    short, whole = predictor.predict_detailed([Request(messages=MESSAGES, tools=TOOLS, mode="none", max_tokens=3),
                                               Request(messages=MESSAGES, tools=TOOLS, mode="none", max_tokens=10**6)])
    assert short.prediction["finished"] is False and short.cut and short.completion_tokens == 3
    assert whole.prediction["finished"] is False and whole.cut and whole.completion_tokens == max_len - prompt


def test_stop_strings_cut_a_text_answer(predictor: Predictor) -> None:
    (full,) = predictor.predict_detailed([Request(messages=MESSAGES, tools=TOOLS, mode="none")])
    content = full.prediction["content"]
    stop = content[len(content) // 3 :][:3]  # a string the answer holds, past its start
    at = content.find(stop)
    (cut,) = predictor.predict_detailed([Request(messages=MESSAGES, tools=TOOLS, mode="none", stop=("\x00", stop))])
    assert cut.prediction == {"content": content[:at], "finished": True} and not cut.cut
    assert 0 < cut.completion_tokens < full.completion_tokens and cut.prompt_tokens == full.prompt_tokens
