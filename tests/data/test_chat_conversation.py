"""Whole conversations through a model's Jinja template (issue 21, item 2, in progress): the
rendering cut into prompt and assistant segments equals transformers' apply_chat_template
(torch tier), and a query/answers row cuts into exactly today's prompt and target.

    JAX_PLATFORMS=cpu .venv/bin/python -m pytest -q tests/data/test_chat_conversation.py -m "torch or not torch"
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
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


GOLDEN = Path(__file__).parent / "fixtures" / "chat_conversation_golden.json"


def make_golden() -> dict[str, str]:
    """transformers' rendering of CONVERSATION per family (needs transformers):
    ``python tests/data/test_chat_conversation.py`` rewrites the fixture."""
    import transformers

    out = {}
    for family in FAMILIES:
        hf = transformers.PreTrainedTokenizerFast(tokenizer_object=raw_tokenizer(family), **FAMILIES[family]["config"])
        hf.chat_template = template(family)
        fmt, row = _fmt(family), parse_row(CONVERSATION, "c:1")
        out[family] = hf.apply_chat_template(fmt.conversation(row), tools=fmt.tools(row), tokenize=False,
                                             **TEMPLATE_KWARGS.get(family, {}))  # fmt: skip
    return out


@pytest.mark.parametrize("family", list(FAMILIES))
def test_conversation_rendering_equals_transformers_golden(family: str) -> None:
    want = json.loads(GOLDEN.read_text(encoding="utf-8"))[family]
    segments = _fmt(family).conversation_segments(parse_row(CONVERSATION, "c:1"))
    assert "".join(text for text, _ in segments) == want


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


@pytest.fixture(scope="module")
def hf_toks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from chat_helpers import write_hf_dir

    from needle.tokenizers.load import load_tokenizer

    root = tmp_path_factory.mktemp("hf")
    return {family: load_tokenizer(write_hf_dir(root / family, family)) for family in FAMILIES}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_query_answers_row_encodes_to_todays_ids_and_mask(family: str, hf_toks: dict[str, Any]) -> None:
    fmt, tok = _fmt(family), hf_toks[family]
    for name in ROWS:
        row = parse_row(ROWS[name], f"{name}:1")
        try:
            today = fmt.encode_example(row, tok, 1 << 30)
        except ChatTemplateError:
            continue  # Llama 3's refusal of parallel calls: refused both ways (above)
        for loss_on in ("all_assistant", "last_assistant"):
            assert fmt.encode_conversation(row, tok, 1 << 30, loss_on) == today


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_loss_mask_covers_exactly_the_assistant_turns(family: str, hf_toks: dict[str, Any]) -> None:
    fmt, tok = _fmt(family), hf_toks[family]
    row = parse_row(CONVERSATION, "c:1")
    segments = fmt.conversation_segments(row)
    want_all = [int(t is not None) for text, t in segments for _ in tok.encode(text)]
    last = max(t for _, t in segments if t is not None)
    want_last = [int(t == last) for text, t in segments for _ in tok.encode(text)]
    every = fmt.encode_conversation(row, tok, 1 << 30)
    assert every.loss_mask == want_all and sum(every.loss_mask) > 0 and not every.truncated
    assert fmt.encode_conversation(row, tok, 1 << 30, "last_assistant").loss_mask == want_last
    assert tok.decode([i for i, m in zip(every.ids, want_last) if m]) == next(x for x, t in segments if t == last)
    assert fmt.encode_conversation(row, tok, 16).truncated  # flagged, so preparation refuses it


def test_conversations_prepare_with_a_chat_template(tmp_path: Any, hf_toks: dict[str, Any]) -> None:
    from needle.config import DataConfig
    from needle.data.load import load_source
    from needle.data.prepare import prepare_rows
    from needle.errors import DataError

    path = tmp_path / "rows.jsonl"
    single = {"query": "Weather in Oslo?", "tools": [WEATHER], "answers": [{"name": "get_weather", "arguments": {"city": "Oslo"}}]}
    path.write_text("\n".join(json.dumps(r) for r in [CONVERSATION, single, CONVERSATION, single]) + "\n")
    cfg = DataConfig(source=str(path), val_fraction=0, test_fraction=0, max_len=1024)
    tok = hf_toks["qwen3"]
    every = prepare_rows(load_source(str(path)), cfg, tok)
    last = prepare_rows(load_source(str(path)), cfg.model_copy(update={"loss_on": "last_assistant"}), tok)
    assert every.stats["rows"]["train"] == 4 and every.fingerprint != last.fingerprint
    assert every.stats["tokens"]["train"]["target"] > last.stats["tokens"]["train"]["target"]
    train = every.splits["train"]
    conv = [r for r in train if r["messages"] is not None]
    assert len(conv) == 2 and conv[0]["query"] is None
    with pytest.raises(DataError, match=r"rows.jsonl:1: row longer than max_len"):
        prepare_rows(load_source(str(path)), cfg.model_copy(update={"max_len": 64}), tok)  # refused, never cut


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    GOLDEN.write_text(json.dumps(make_golden(), indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {GOLDEN}")
