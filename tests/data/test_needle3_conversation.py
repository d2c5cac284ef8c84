"""Needle 3's format renders whole conversations (issue 21, item 2): tool results in Needle's
``<tool_result>`` markers, loss on the assistant turns, a query/answers row as today."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_conversation import GOOD, WEATHER

from needle.data.needle3_format import Needle3Format, conversation_segments
from needle.data.schema import parse_row
from needle.tokenizers.base import SP_MODEL_FILE
from needle.tokenizers.needle3 import Needle3Tokenizer

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "needle3_format"


@pytest.fixture(scope="module")
def tok() -> Needle3Tokenizer:
    return Needle3Tokenizer.load(FIXTURES / SP_MODEL_FILE)


def test_a_query_answers_row_encodes_as_the_reference_row(tok: Needle3Tokenizer) -> None:
    fmt = Needle3Format()
    for record in (
        {"query": "Weather in Oslo?", "tools": [WEATHER], "answers": [{"name": "get_weather", "arguments": {"city": "Oslo"}}],
         "system": " Be brief. ", "reasoning": "the weather tool"},
        {"query": "A poem?", "tools": [WEATHER], "answers": []},
    ):  # fmt: skip
        row = parse_row(record, "r:1")
        prompt, target = fmt.render_prompt(row), fmt.render_target(row)
        assert conversation_segments(row) == [(prompt, None), (target, 2 if row.system else 1)]  # the assistant's index
        for loss_on in ("all_assistant", "last_assistant"):
            assert fmt.encode_conversation(row, tok, 1 << 30, loss_on) == fmt.encode_example(row, tok, 1 << 30)


def test_tool_results_render_in_needles_markers_and_carry_no_loss(tok: Needle3Tokenizer) -> None:
    row = parse_row({"messages": GOOD, "tools": [WEATHER]}, "c:1")
    segments = conversation_segments(row)
    assert [t for _, t in segments] == [None, 2, None, 4]
    assert segments[2][0] == ('\n<|im_start|>tool\n<tool_result>{"name":"get_weather","content":"{\\"temp\\": 3}"}'
                              "</tool_result><|im_end|>\n<|im_start|>assistant\n")  # fmt: skip
    assert segments[3][0] == "It is 3 degrees.<|im_end|>"
    ex = Needle3Format().encode_conversation(row, tok, 1 << 30)
    want = [0] + [int(t is not None) for text, t in segments for _ in tok.encode(text)] + [1]  # bos, ..., eos
    assert ex.loss_mask == want and ex.ids[0] == tok.bos_id and ex.ids[-1] == tok.eos_id
    last = Needle3Format().encode_conversation(row, tok, 1 << 30, "last_assistant")
    assert sum(last.loss_mask) == len(tok.encode(segments[3][0])) + 1
