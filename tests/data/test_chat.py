"""Chat formats: a model's Jinja template rendered as transformers does, loss masks, stop ids.

The default tier compares against fixtures/chat_golden.json (transformers' own output); the
``torch`` tier re-renders with transformers itself and round-trips a ``save_pretrained``
tokenizer directory.

    .venv/bin/python -m pytest -q tests/data/test_chat.py            # add -m torch for the tier
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from chat_helpers import FAMILIES, GOLDEN, ROWS, TEMPLATE_KWARGS, raw_tokenizer, template, write_hf_dir

from needle.data.chat import ChatTemplateError, JinjaChatFormat, format_for
from needle.data.render import TEMPLATE, ChatFormat, NativeFormat
from needle.data.schema import Row, parse_row
from needle.tokenizers.hf import HFTokenizer
from needle.tokenizers.load import load_tokenizer

CASES = [(f, r) for f in FAMILIES for r in ROWS]


def _row(name: str) -> Row:
    return parse_row(ROWS[name], f"{name}:1")


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {family: write_hf_dir(root / family, family) for family in FAMILIES}


def _format(hf_dirs: dict[str, Path], family: str) -> tuple[HFTokenizer, JinjaChatFormat]:
    tok = load_tokenizer(hf_dirs[family])
    assert isinstance(tok, HFTokenizer)
    fmt = format_for(tok, TEMPLATE_KWARGS.get(family))
    assert isinstance(fmt, JinjaChatFormat) and isinstance(fmt, ChatFormat)
    return tok, fmt


@pytest.mark.parametrize(("family", "name"), CASES)
def test_rendering_equals_transformers_golden(hf_dirs: dict[str, Path], family: str, name: str) -> None:
    golden = json.loads(GOLDEN.read_text(encoding="utf-8"))[f"{family}/{name}"]
    _, fmt = _format(hf_dirs, family)
    row = _row(name)
    if "error" in golden:  # Llama 3.x refuses parallel calls: so must we, naming the row
        with pytest.raises(ChatTemplateError, match=f"{name}:1: .*{golden['error']}"):
            fmt.encode_example(row, load_tokenizer(hf_dirs[family]), 4096)
        return
    assert fmt.render_prompt(row) == golden["prompt"]
    assert fmt.render_prompt(row) + fmt.render_target(row) == golden["full"]


@pytest.mark.parametrize(("family", "name"), [c for c in CASES if c != ("llama3", "parallel")])
def test_loss_mask_is_exactly_the_assistant_turn_and_parses_back(hf_dirs: dict[str, Path], family: str,
                                                                 name: str) -> None:  # fmt: skip
    tok, fmt = _format(hf_dirs, family)
    row = _row(name)
    ex = fmt.encode_example(row, tok, max_len=4096)
    first = ex.loss_mask.index(1)
    assert not ex.truncated and not any(ex.loss_mask[:first]) and all(ex.loss_mask[first:])
    assert tok.decode(ex.ids[:first]) == fmt.render_prompt(row)
    assert tok.decode(ex.ids[first:]) == fmt.render_target(row)
    # What greedy decoding would return: the target up to the first stop id, then parsed.
    target = ex.ids[first:]
    stop = next(i for i, t in enumerate(target) if t in tok.stop_ids)
    assert target[stop] == tok.end_id
    assert fmt.parse(tok.decode(target[:stop])).calls == row.answers


def test_stop_ids_per_family(hf_dirs: dict[str, Path]) -> None:
    for family, spec in FAMILIES.items():
        tok = load_tokenizer(hf_dirs[family])
        ids = {t: tok.token_id(t) for t in spec["specials"]}
        end = {"qwen3": "<|im_end|>", "llama3": "<|eot_id|>", "gemma3": "<end_of_turn>"}[family]
        assert tok.end_id == ids[end] and tok.stop_ids[0] == tok.end_id
        assert set(tok.stop_ids) == {ids[t] for t in spec["generation_eos"]} | {tok.end_id}
    assert load_tokenizer(hf_dirs["qwen3"]).pad_id == load_tokenizer(hf_dirs["qwen3"]).token_id("<|endoftext|>")
    llama = load_tokenizer(hf_dirs["llama3"])
    assert llama.pad_id == llama.token_id("<|eot_id|>")  # no pad_token: eos pads


def test_hf_tokenizer_save_load_round_trip(hf_dirs: dict[str, Path], tmp_path: Path) -> None:
    tok = load_tokenizer(hf_dirs["qwen3"])
    tok.save(tmp_path)
    files = {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"}
    assert {p.name for p in tmp_path.iterdir()} == files
    back = load_tokenizer(tmp_path)
    assert back.stop_ids == tok.stop_ids  # generation_config's extra eos ids survive a save
    assert back == tok and back.to_json() == (hf_dirs["qwen3"] / "tokenizer.json").read_text(encoding="utf-8")
    text = "<|im_start|>user\nhéllo 🎉 Zürich<|im_end|>\n<tool_call>"
    assert back.decode(back.encode(text)) == text and back.encode(text)[0] == back.token_id("<|im_start|>")


def test_native_tokenizer_is_detected_and_keeps_its_bytes(data_tokenizer, tmp_path: Path) -> None:
    path = data_tokenizer.save(tmp_path)
    tok = load_tokenizer(tmp_path)
    assert tok == data_tokenizer and tok.to_json() == path.read_text(encoding="utf-8")
    assert tok.stop_ids == (tok.end_id,) and tok.chat_template is None
    assert isinstance(format_for(tok), NativeFormat)


def test_hf_tokenizer_without_template_falls_back_to_needles_and_says_so(tmp_path: Path, caplog) -> None:
    tok = load_tokenizer(write_hf_dir(tmp_path, "gemma3", with_template=False))
    with caplog.at_level(logging.WARNING, logger="needle.data.chat"):
        fmt = format_for(tok)
    assert isinstance(fmt, NativeFormat) and "no chat template" in caplog.text
    row = _row("single")
    ex = fmt.encode_example(row, tok, 4096)
    # Needle's markers are plain text to this vocabulary: the tokenizer's own end closes the target.
    assert ex.ids[-1] == tok.end_id and tok.decode(ex.ids[ex.loss_mask.index(1) : -1]) == fmt.render_target(row)
    assert fmt.parse(tok.decode(ex.ids[ex.loss_mask.index(1) : -1])).calls == row.answers


def test_template_ids_name_what_renders() -> None:
    assert TEMPLATE in NativeFormat().template_id()
    qwen = JinjaChatFormat(template("qwen3"), {"eos_token": "<|im_end|>"})
    assert qwen.template_id() != JinjaChatFormat(template("gemma3"), {"eos_token": "<|im_end|>"}).template_id()
    assert qwen.template_id() != JinjaChatFormat(template("qwen3"), {"eos_token": "<|im_end|>"},
                                                 {"enable_thinking": False}).template_id()  # fmt: skip


def test_a_template_that_rewrites_history_is_an_error() -> None:
    # The generation prompt here is not what the full conversation starts with.
    odd = "{% for m in messages %}{{ m.role }}{% endfor %}{% if add_generation_prompt %}<go>{% endif %}"
    with pytest.raises(ChatTemplateError, match="single:1: .*not a prefix"):
        JinjaChatFormat(odd).render_target(_row("single"))


def test_sandbox_and_transformers_globals() -> None:
    fmt = JinjaChatFormat("{{ raise_exception('no ' + messages[0].role) }}")
    with pytest.raises(ChatTemplateError, match="no user"):
        fmt.render([{"role": "user", "content": "x"}], None)
    fmt = JinjaChatFormat("{{ messages | tojson }}{{ dict(a=1) | tojson }}{% set ns = namespace(n=1) %}{{ ns.n }}")
    assert fmt.render([{"role": "user", "content": "<é>"}], None) == '[{"role": "user", "content": "<é>"}]{"a": 1}1'
    with pytest.raises(Exception, match="unsafe|underscore|access"):
        JinjaChatFormat("{{ messages.__class__.__mro__ }}{% set ns = namespace(_x=1) %}").render([], None)


@pytest.mark.torch
@pytest.mark.parametrize("family", list(FAMILIES))
def test_transformers_renders_the_same_and_its_save_pretrained_dir_loads(family: str, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=raw_tokenizer(family), **FAMILIES[family]["config"])
    hf.chat_template = template(family)
    hf.save_pretrained(tmp_path)
    assert (tmp_path / "chat_template.jinja").is_file()
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, HFTokenizer) and tok.chat_template == template(family)
    fmt = format_for(tok, TEMPLATE_KWARGS.get(family))
    kw = TEMPLATE_KWARGS.get(family, {})
    for name in ROWS:
        row = _row(name)
        messages, tools = fmt.messages(row), fmt.tools(row)
        try:
            want = hf.apply_chat_template(messages, tools=tools, tokenize=False, **kw)
        except Exception as exc:  # noqa: BLE001
            with pytest.raises(ChatTemplateError, match=str(exc)):
                fmt.render_target(row)
            continue
        assert fmt.render_prompt(row) + fmt.render_target(row) == want
        assert fmt.render_prompt(row) == hf.apply_chat_template(messages[:-1], tools=tools, tokenize=False,
                                                                add_generation_prompt=True, **kw)  # fmt: skip
        assert tok.encode(want) == hf(want, add_special_tokens=False)["input_ids"]
        assert tok.decode(tok.encode(want)) == hf.decode(hf(want, add_special_tokens=False)["input_ids"])


SAMPLE_CONVERSATIONS = Path(__file__).resolve().parents[2] / "data" / "sample" / "conversations.jsonl"
SMOLLM2_TEMPLATE = (  # SmolLM2-135M-Instruct's (its GGUF file's tokenizer.chat_template): no tools, no tool_calls
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>'"
    " + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.mark.parametrize("family", ["gemma3", "smollm2"])
def test_tool_listing_template_shows_openai_tools_as_needle_trained(hf_dirs: dict[str, Path], family: str) -> None:
    """A GGUF export's template (with_tool_listing): a client's OpenAI ``tools`` reach the model as
    needle trained it, and needle reading the file back renders every row as before."""
    from needle.data.chat import with_tool_listing

    if family == "smollm2":
        fmt = JinjaChatFormat(SMOLLM2_TEMPLATE)
    else:
        fmt = _format(hf_dirs, family)[1]
    assert not fmt.renders_tools
    wrapped = JinjaChatFormat(with_tool_listing(fmt.template), fmt.special_tokens, fmt.template_kwargs)
    assert wrapped.renders_tools and not wrapped.renders_calls
    for name in ROWS:
        row = _row(name)
        assert wrapped.split(row) == fmt.split(row)
        # What an OpenAI route hands the template: the request's messages and tools, as sent.
        messages = [*([{"role": "system", "content": row.system}] if row.system else []),
                    {"role": "user", "content": row.query}]  # fmt: skip
        tools = [{"type": "function", "function": t} for t in row.tools]
        assert wrapped.render(messages, tools, add_generation_prompt=True) == fmt.render_prompt(row)
    plain = [{"role": "user", "content": "hi"}]  # no tools: the template's own chat
    assert wrapped.render(plain, None, add_generation_prompt=True) == fmt.render(plain, None, add_generation_prompt=True)
    conversation = parse_row(json.loads(SAMPLE_CONVERSATIONS.read_text().splitlines()[0]), "c:1")
    assert wrapped.conversation(conversation) != fmt.conversation(conversation)  # the listing moves into the template
    tok = load_tokenizer(hf_dirs["gemma3"])
    assert wrapped.encode_conversation(conversation, tok, 4096).ids == fmt.encode_conversation(conversation, tok, 4096).ids


def test_tool_listing_leaves_a_template_that_renders_tools() -> None:
    from needle.data.chat import with_tool_listing

    assert with_tool_listing(template("qwen3")) == template("qwen3")
