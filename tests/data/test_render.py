"""Chat template text, loss mask boundaries and truncation."""

from __future__ import annotations

from data_helpers import good_row

from needle.data.render import DEFAULT_SYSTEM, encode_example, format_calls, render_prompt, render_target
from needle.data.schema import parse_row
from needle.tokenizers.native import Tokenizer


def test_template_text_is_exact() -> None:
    row = parse_row(good_row(tools=[{"name": "t", "parameters": {"type": "object", "properties": {}}}],
                             answers=[{"name": "t", "arguments": {}}], query="héllo"), "s:1")  # fmt: skip
    assert render_prompt(row) == (
        f"<|bos|><|system|>{DEFAULT_SYSTEM}<|end|>"
        '<|tools|>[{"name":"t","parameters":{"type":"object","properties":{}}}]<|end|>'
        "<|user|>héllo<|end|><|assistant|>"
    )
    assert render_target(row) == '<|call|>[{"name":"t","arguments":{}}]<|end|>'


def test_system_reasoning_and_off_topic() -> None:
    row = parse_row(good_row(system="Be terse.", reasoning="a timer fits", answers=[]), "s:1")
    assert render_prompt(row).startswith("<|bos|><|system|>Be terse.<|end|><|tools|>")
    assert render_target(row) == "<|think|>a timer fits<|call|>[]<|end|>"


def test_format_calls_is_compact_and_keeps_unicode() -> None:
    calls = [{"name": "note", "arguments": {"text": "café ☕", "n": 2}}]
    assert format_calls(calls) == '[{"name":"note","arguments":{"text":"café ☕","n":2}}]'


def test_loss_mask_covers_exactly_the_target(data_tokenizer: Tokenizer) -> None:
    row = parse_row(good_row(reasoning="why"), "s:1")
    ex = encode_example(row, data_tokenizer, max_len=1000)
    assert not ex.truncated and len(ex.ids) == len(ex.loss_mask)
    first = ex.loss_mask.index(1)
    assert all(ex.loss_mask[first:]) and not any(ex.loss_mask[:first])
    assert data_tokenizer.decode(ex.ids[:first]) == render_prompt(row)
    assert data_tokenizer.decode(ex.ids[first:]) == render_target(row)
    assert ex.ids[first] == data_tokenizer.token_id("<|think|>") and ex.ids[-1] == data_tokenizer.end_id


def test_truncation_keeps_the_first_tokens_and_says_so(data_tokenizer: Tokenizer) -> None:
    row = parse_row(good_row(), "s:1")
    full = encode_example(row, data_tokenizer, max_len=1000)
    cut = encode_example(row, data_tokenizer, max_len=len(full.ids) - 3)
    assert cut.truncated and cut.ids == full.ids[:-3] and cut.loss_mask == full.loss_mask[:-3]
    assert not encode_example(row, data_tokenizer, max_len=len(full.ids)).truncated
