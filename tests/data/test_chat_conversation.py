"""Whole conversations through a model's Jinja template (issue 21, item 2, in progress): the
rendering cut into prompt and assistant segments equals transformers' apply_chat_template
(torch tier), and a query/answers row cuts into exactly today's prompt and target.

    JAX_PLATFORMS=cpu .venv/bin/python -m pytest -q tests/data/test_chat_conversation.py -m "torch or not torch"
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from chat_helpers import FAMILIES, ROWS, TEMPLATE_KWARGS, TIMER, WEATHER, raw_tokenizer, template

from needle.data.chat import ChatTemplateError, JinjaChatFormat
from needle.data.schema import parse_row

CONVERSATION = {"tools": [TIMER, WEATHER], "messages": [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Zürich?"},
    {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                          "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}]},
    {"role": "tool", "tool_call_id": "c1", "content": json.dumps({"temp_c": 3, "sky": "snow"})},
    {"role": "assistant", "content": "3 °C and snowing."},
    {"role": "user", "content": "Then a 5 minute tea timer"},
    {"role": "assistant", "tool_calls": [{"id": "c2", "type": "function",
                                          "function": {"name": "set_timer", "arguments": {"minutes": 5}}}]},
    {"role": "tool", "tool_call_id": "c2", "content": "started"},
    {"role": "assistant", "content": "Timer set."},
]}  # fmt: skip


def _fmt(family: str) -> JinjaChatFormat:
    return JinjaChatFormat(template(family), FAMILIES[family]["config"], TEMPLATE_KWARGS.get(family))


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("name", list(ROWS))
def test_a_query_answers_row_cuts_into_todays_prompt_and_target(family: str, name: str) -> None:
    fmt, row = _fmt(family), parse_row(ROWS[name], f"{name}:1")
    assert fmt.conversation(row) == fmt.messages(row)
    try:
        prompt, target = fmt.split(row)
    except ChatTemplateError:
        with pytest.raises(ChatTemplateError):
            fmt.conversation_segments(row)
        return
    last = len(fmt.messages(row)) - 1
    assert fmt.conversation_segments(row) == [(prompt, None), (target, last)]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_conversation_segments_cover_each_assistant_turn(family: str) -> None:
    fmt = _fmt(family)
    segments = fmt.conversation_segments(parse_row(CONVERSATION, "c:1"))
    turns = [t for _, t in segments if t is not None]
    msgs = fmt.conversation(parse_row(CONVERSATION, "c:1"))
    assert turns == [i for i, m in enumerate(msgs) if m["role"] == "assistant"] and len(turns) == 4
    loss_text = "".join(text for text, t in segments if t is not None)
    assert "3 °C and snowing." in loss_text and "Timer set." in loss_text
    assert "started" not in loss_text and "Weather in Zürich?" not in loss_text and "temp_c" not in loss_text


@pytest.mark.torch
@pytest.mark.parametrize("family", list(FAMILIES))
def test_conversation_rendering_equals_transformers(family: str) -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=raw_tokenizer(family), **FAMILIES[family]["config"])
    hf.chat_template = template(family)
    fmt, row = _fmt(family), parse_row(CONVERSATION, "c:1")
    msgs, tools = fmt.conversation(row), fmt.tools(row)
    want = hf.apply_chat_template(msgs, tools=tools, tokenize=False, **TEMPLATE_KWARGS.get(family, {}))
    segments = fmt.conversation_segments(row)
    assert "".join(text for text, _ in segments) == want
    for text, turn in segments:  # each assistant segment starts where transformers' generation prompt ends
        if turn is not None:
            prompt = hf.apply_chat_template(msgs[:turn], tools=tools, tokenize=False, add_generation_prompt=True,
                                            **TEMPLATE_KWARGS.get(family, {}))  # fmt: skip
            assert want[len(prompt):].startswith(text)
    if family != "gemma3":
        assert any(m["role"] == "tool" for m in msgs)  # tool results in the template's own role
