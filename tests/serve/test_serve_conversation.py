"""Serving whole conversations: the prompt is the conversation rendered as training renders it,
and under the grammar a turn is calls or text as ``tool_choice`` asks (a random tiny model)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from needle.data.render import NativeFormat, conversation_segments, encode_prompts
from needle.data.schema import Row, parse_row
from needle.data.turns import conversation_prompt
from needle.eval.constrain import arguments_schema
from needle.eval.reply import read_reply
from needle.model.io import load_model
from needle.serve.engine import Predictor
from needle.serve.prompt import Request, conversation_row

WEATHER = {"name": "get_weather", "description": "Current weather for a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}  # fmt: skip
MESSAGE = {"name": "send_message", "description": "Send a text message",
           "parameters": {"type": "object", "properties": {"contact": {"type": "string"}, "text": {"type": "string"}},
                          "required": ["contact", "text"]}}  # fmt: skip
TOOLS = [WEATHER, MESSAGE]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
SO_FAR = [
    {"role": "user", "content": "Is it raining in Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"rain": true}'},
]


@pytest.fixture(scope="module")
def predictor(tiny_model_dir) -> Predictor:
    return Predictor(load_model(tiny_model_dir))


def test_prompt_is_the_conversation_as_training_renders_it(predictor: Predictor) -> None:
    tok, fmt = predictor.tok, NativeFormat()
    answered = parse_row({"messages": [*SO_FAR, {"role": "assistant", "content": "Yes, it rains."}], "tools": TOOLS}, "t")
    segments = conversation_segments(answered)  # the training rendering of the whole conversation
    before_last = [text for text, _ in segments[:-1]]
    want: list[int] = []
    for text, turn in segments[:-1]:
        ids = tok.encode(text)
        want += ids + ([tok.end_id] if turn is not None and ids[-1:] != [tok.end_id] else [])
    prompt = conversation_prompt(fmt, conversation_row(SO_FAR, TOOLS), tok)
    assert prompt == want
    assert '<|tools|>{"name":"get_weather","content":"{\\"rain\\": true}"}<|end|>' in "".join(before_last)
    assert tok.decode(prompt).endswith('<|tools|>{"name":"get_weather","content":"{\\"rain\\": true}"}<|end|><|assistant|>')
    # The earlier call is in the prompt as the model wrote it in training.
    assert '<|assistant|><|call|>[{"name":"get_weather","arguments":{"city":"Oslo"}}]<|end|>' in tok.decode(prompt)
    # One user message is today's single-turn prompt.
    single = conversation_prompt(fmt, conversation_row(SO_FAR[:1], TOOLS), tok)
    row = Row(query=SO_FAR[0]["content"], tools=TOOLS, answers=[], reasoning=None, system=None, source="q")
    assert single == encode_prompts(fmt, [row], tok)[0]


@pytest.mark.parametrize("messages, why", [
    ([], "non-empty list"),
    ([{"role": "tool", "tool_call_id": "x", "content": "1"}], "cannot come first"),
    (SO_FAR[:2], "messages[1] (assistant) calls tools whose results are missing"),
    ([*SO_FAR, SO_FAR[1], SO_FAR[2]], "messages[3] (assistant) tool_calls[0] id 'call_1' is used twice"),
    ([*SO_FAR[:2], {"role": "tool", "tool_call_id": "call_9", "content": "1"}], "answers no earlier call"),
    ([SO_FAR[0], {"role": "assistant", "content": None, "tool_calls": [{**CALL, "function": {"name": "nope", "arguments": "{}"}}]},
      {**SO_FAR[2]}], "nope"),
    ([*SO_FAR, {"role": "assistant", "content": "It rains."}], "must end with a user message or tool results"),
])  # fmt: skip
def test_bad_conversations_are_refused_with_the_message(messages, why) -> None:
    with pytest.raises(ValueError, match=re.escape(why)):
        conversation_row(messages, TOOLS)


def test_the_servers_empty_reply_sent_back_is_the_empty_call_list(predictor: Predictor) -> None:
    """"No tool fits" is answered as ``content: ""`` without calls; sent back as history it is the
    ``[]`` answer training renders, not a refused turn."""
    asked = {"role": "user", "content": "Tell me a joke"}
    echoed = [asked, {"role": "assistant", "content": ""}, {"role": "user", "content": "Then the weather in Oslo?"}]
    trained = [asked, {"role": "assistant", "content": None, "tool_calls": []}, echoed[2]]
    tok, fmt = predictor.tok, NativeFormat()
    prompt = conversation_prompt(fmt, conversation_row(echoed, TOOLS), tok)
    assert prompt == conversation_prompt(fmt, conversation_row(trained, TOOLS), tok)
    assert "<|assistant|><|call|>[]<|end|>" in tok.decode(prompt)


def _valid(calls: list, tools: list) -> None:
    by_name = {t["name"]: t for t in tools}
    for call in calls:
        jsonschema.validate(call["arguments"], arguments_schema(by_name[call["name"]]))


def test_modes_give_calls_or_text_under_the_grammar(predictor: Predictor) -> None:
    requests = [Request(messages=SO_FAR, tools=TOOLS, mode=mode) for mode in ("auto", "none", "required")]
    requests.append(Request(messages=SO_FAR, tools=TOOLS, mode="required", only="send_message"))
    requests.append(Request(messages=SO_FAR[:1], tools=[], mode="auto"))
    requests.append(Request(messages=SO_FAR[:2], tools=TOOLS, mode="auto"))  # a call without its result
    auto, none, required, only, no_tools, bad = predictor.predict(requests, constrained=True)
    assert isinstance(auto, list) and auto or isinstance(auto, dict) and isinstance(auto["content"], str), auto
    if isinstance(auto, list):
        _valid(auto, TOOLS)
    assert isinstance(none, dict) and none["content"].strip() and "finished" in none, none
    assert isinstance(required, list) and required, required
    _valid(required, TOOLS)
    assert isinstance(only, list) and only and {c["name"] for c in only} == {"send_message"}, only
    _valid(only, TOOLS)
    assert isinstance(no_tools, dict) and "content" in no_tools, no_tools
    assert "error" in bad and "results are missing" in bad["error"]
    # A query (the table shape's single turn) still answers a call list, [] included.
    (query,) = predictor.predict([("Text Bob hi", TOOLS)])
    assert isinstance(query, list)


def test_auto_reads_back_calls_or_text() -> None:
    fmt = NativeFormat()
    call = '<|call|>[{"name":"get_weather","arguments":{"city":"Oslo"}}]'
    assert read_reply(fmt, call).calls == [{"name": "get_weather", "arguments": {"city": "Oslo"}}]
    assert read_reply(fmt, "<|call|>[]").content == ""
    assert read_reply(fmt, "Yes, it rains.<|end|>").content == "Yes, it rains."
    assert read_reply(fmt, "<|call|>[{broken").error


# --- every format family: the prompt, the auto grammar and the read-back ------------------------
FAMILY_ROWS = [json.dumps({"messages": SO_FAR, "tools": TOOLS})] * 5 + ["Yes, it rains in Oslo."] * 5


def _family(name: str, root: Path) -> tuple[Any, Any]:
    """(tokenizer, format) of a chat family (a tiny HF tokenizer with its template) or Needle 3's."""
    if name == "needle3":
        from needle.data.needle3_format import Needle3Format
        from needle.tokenizers.base import SP_MODEL_FILE
        from needle.tokenizers.needle3 import Needle3Tokenizer

        return Needle3Tokenizer.load(Path(__file__).parents[1] / "fixtures" / "needle3_format" / SP_MODEL_FILE), \
            Needle3Format()  # fmt: skip
    from needle.data.chat import format_for
    from needle.model.hf.random_model import FAMILIES, family_template, train_family_tokenizer
    from needle.tokenizers.load import load_tokenizer

    raw = train_family_tokenizer(FAMILY_ROWS, name, 400)
    raw.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps(FAMILIES[name]["config"]), encoding="utf-8")
    (root / "chat_template.jinja").write_text(family_template(name), encoding="utf-8")
    eos = [raw.token_to_id(t) for t in FAMILIES[name]["generation_eos"]]
    (root / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}), encoding="utf-8")
    tok = load_tokenizer(root)
    return tok, format_for(tok, {"date_string": "26 Jul 2024"} if name == "llama3" else None)


# What each family writes for a call (the grammar's form), and a text answer.
CALLS = {
    "qwen3": '<think>\n\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
    "llama3": '{"name": "get_weather", "parameters": {"city": "Oslo"}}',
    "gemma3": '[{"name": "get_weather", "arguments": {"city": "Oslo"}}]',
    "needle3": '<tool_call>[{"name":"get_weather","arguments":{"city":"Oslo"}}]</tool_call>',
}
TEXTS = {"qwen3": "<think>\n\n</think>\n\nYes, it rains."}


@pytest.mark.parametrize("name", list(CALLS))
def test_each_family_prompts_and_reads_calls_or_text(name: str, tmp_path: Path) -> None:
    from needle.eval.constrain import Constraints

    tok, fmt = _family(name, tmp_path)
    answered = parse_row({"messages": [*SO_FAR, {"role": "assistant", "content": "Yes, it rains."}], "tools": TOOLS}, "t")
    full = fmt.encode_conversation(answered, tok, 1 << 30, "last_assistant")
    cut = len(full.ids) - sum(full.loss_mask)  # the answer turn is the run of loss tokens at the end
    assert conversation_prompt(fmt, conversation_row(SO_FAR, TOOLS), tok) == full.ids[:cut]
    assert "rain" in tok.decode(full.ids[:cut])  # the tool result is in the prompt
    cons = Constraints.for_tokenizer(tok, fmt)
    text = TEXTS.get(name, "Yes, it rains.")
    for answer, mode, ok in ((CALLS[name], "auto", True), (text, "auto", True), (text, "none", True),
                             (CALLS[name], "none", False), (text, "required", False)):  # fmt: skip
        m = cons.matcher(TOOLS, mode)
        accepted = m.consume_tokens(tok.encode(answer)) and m.is_accepting()
        assert accepted == ok, (name, mode, answer, m.get_error())
    assert read_reply(fmt, CALLS[name]).calls == [{"name": "get_weather", "arguments": {"city": "Oslo"}}]
    assert read_reply(fmt, text).content == "Yes, it rains."


def test_a_text_answer_is_not_closed_early_and_says_it_was_cut(tiny_model_dir) -> None:
    """Steering (CLOSE_RESERVE) closes call lists near the budget's end; text runs to the budget,
    so a cut answer reports ``finished: False`` (``finish_reason: "length"``), not an early stop."""
    from needle.config import EvalConfig

    loaded = load_model(tiny_model_dir)
    predictor = Predictor(loaded, EvalConfig(max_new_tokens=40))
    (text,) = predictor.predict([Request(messages=SO_FAR, tools=TOOLS, mode="none")], constrained=True)
    (free,) = predictor.predict([Request(messages=SO_FAR, tools=TOOLS, mode="none")], constrained=False)
    assert isinstance(text, dict) and "content" in text, text
    # The random model never stops by itself here (free decoding runs out too), so neither may the grammar.
    assert free.get("finished") is False or "error" in free, free
    assert text["finished"] is False
    assert len(loaded.tokenizer.encode(text["content"])) > 40 - 24
