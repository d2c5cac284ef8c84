"""Steering a constrained row to close its call list near the end of its budget (CLOSE_RESERVE)
applies only once the row has opened a call list: a small budget cuts a text answer, it does not
change it from its first token (a budget of 24 or less once pushed every row from the start)."""

from __future__ import annotations

from pathlib import Path

import pytest

from needle.eval.constrain import CLOSE_RESERVE
from needle.serve.prompt import Request
from needle.serve.pyfunc import EXAMPLE_TOOLS

MESSAGES = [{"role": "user", "content": "Text Bob that dinner is at 8"}]


@pytest.fixture(scope="module")
def predictor(tiny_model_dir: Path):
    from needle.model.io import load_model
    from needle.serve.engine import Predictor

    return Predictor(load_model(tiny_model_dir))


def _ids(predictor, mode: str, budget: int | None) -> list[int]:
    """The ids one constrained decode of MESSAGES writes in ``mode`` with ``budget``."""
    from needle.eval.decode import generate_detailed
    from needle.data.turns import conversation_prompt
    from needle.serve.prompt import conversation_row

    prompt = conversation_prompt(predictor.fmt, conversation_row(MESSAGES, EXAMPLE_TOOLS), predictor.tok)
    cons = predictor.constraints()
    gen = generate_detailed(predictor.model, predictor.loaded.params, [prompt], max_new_tokens=budget or 96,
                            end_id=predictor.tok.stop_ids, pad_id=predictor.tok.pad_id, batch_size=1,
                            matchers=[cons.matcher(EXAMPLE_TOOLS, mode)], constraints=cons)  # fmt: skip
    return gen.ids[0] + [-1] * gen.finished[0]


@pytest.mark.parametrize("mode", ["auto", "none"])
def test_a_small_budget_cuts_a_text_answer_without_changing_it(predictor, mode: str) -> None:
    whole = _ids(predictor, mode, None)
    assert predictor.constraints().opens_call_list(whole) is False  # the tiny model answers in words here
    for budget in (1, 3, CLOSE_RESERVE, CLOSE_RESERVE + 5):
        assert _ids(predictor, mode, budget) == whole[:budget], budget
    # Through the engine too (max_tokens, as a chat request sends it): the words are the start of the default's.
    (short,), (full,) = (predictor.predict([Request(messages=MESSAGES, tools=EXAMPLE_TOOLS, mode=mode, max_tokens=b)])
                         for b in (3, None))  # fmt: skip
    assert full["content"].startswith(short["content"]) and short["finished"] is False


def test_a_call_list_opened_near_the_end_is_still_closed(predictor) -> None:
    cons = predictor.constraints()
    for budget in (CLOSE_RESERVE, CLOSE_RESERVE + 6):
        ids = _ids(predictor, "required", budget)
        assert cons.opens_call_list(ids) and ids[-1] == -1, budget  # opened, then closed before the budget ran out
        assert predictor.fmt.parse(predictor.tok.decode(ids[:-1])).ok, budget
    assert cons.opens_call_list(predictor.tok.encode("Sure, at 8.")) is False
    assert cons.opens_call_list([]) is False
