"""Chat-template test material: template fixtures, rows, and tiny HF-layout tokenizers built offline.

Imported as ``chat_helpers`` (pytest puts tests/data on the path). The family templates in
needle/data/templates/ were written for these tests to reproduce the output format of Qwen3
(Hermes ``<tool_call>``), Llama 3.2 (JSON calls) and Gemma 3 (no tool support);
fixtures/chat_golden.json holds transformers' ``apply_chat_template`` output for them
(regenerate with ``python tests/data/chat_helpers.py`` in a venv with transformers).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as RawTokenizer

FIXTURES = Path(__file__).parent / "fixtures"
GOLDEN = FIXTURES / "chat_golden.json"
# Fixed so the Llama template's "Today Date" does not depend on the day the tests run.
TEMPLATE_KWARGS = {"llama3": {"date_string": "26 Jul 2024"}}
# The family specials, tokenizer_config and generation eos live with the demo-model generator.
from needle.model.hf.random_model import FAMILIES, family_template, train_family_tokenizer  # noqa: E402

TIMER = {
    "name": "set_timer",
    "description": "Start a countdown timer",
    "parameters": {
        "type": "object",
        "properties": {"minutes": {"type": "integer"}, "label": {"type": "string", "description": "café ☕ <b>"}},
        "required": ["minutes"],
    },
}
WEATHER = {
    "name": "get_weather",
    "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
ROWS: dict[str, dict[str, Any]] = {
    "single": {"query": "Set a timer for 5 minutes", "tools": [TIMER, WEATHER],
               "answers": [{"name": "set_timer", "arguments": {"minutes": 5, "label": "tea"}}]},
    "parallel": {"query": "Timer for 3 minutes, and the weather in Zürich?", "tools": [TIMER, WEATHER],
                 "answers": [{"name": "set_timer", "arguments": {"minutes": 3}},
                             {"name": "get_weather", "arguments": {"city": "Zürich"}}]},
    "off_topic": {"query": "Write me a poem", "tools": [WEATHER], "answers": []},
    "system_reasoning": {"query": "Weather in Oslo", "tools": [WEATHER], "system": "Be brief.",
                         "reasoning": "the weather tool fits",
                         "answers": [{"name": "get_weather", "arguments": {"city": "Oslo"}}]},
}  # fmt: skip
CORPUS = [json.dumps(r, ensure_ascii=False) for r in ROWS.values()] * 5 + ["Given the following functions"] * 5


def template(family: str) -> str:
    return family_template(family)


def raw_tokenizer(family: str, vocab_size: int = 400) -> RawTokenizer:
    """A byte-level BPE with the family's special tokens, trained on a few rows (milliseconds)."""
    return train_family_tokenizer(CORPUS, family, vocab_size)


def write_hf_dir(directory: Path, family: str, with_template: bool = True) -> Path:
    """A Hugging Face tokenizer directory as transformers 5 writes it, without transformers."""
    directory.mkdir(parents=True, exist_ok=True)
    raw = raw_tokenizer(family)
    raw.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(FAMILIES[family]["config"]), encoding="utf-8")
    if with_template:
        (directory / "chat_template.jinja").write_text(template(family), encoding="utf-8")
    eos = [raw.token_to_id(t) for t in FAMILIES[family]["generation_eos"]]
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}), encoding="utf-8")
    return directory


def openai_conversation(fmt: Any, row: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages and tools a JinjaChatFormat builds for ``row`` (what transformers is given)."""
    return fmt.messages(row), fmt.tools(row)


def make_golden() -> dict[str, Any]:
    """transformers' renderings of every row with every family template (needs transformers)."""
    from transformers import PreTrainedTokenizerFast

    from needle.data.chat import JinjaChatFormat
    from needle.data.schema import parse_row

    golden: dict[str, Any] = {}
    for family in FAMILIES:
        tok = PreTrainedTokenizerFast(tokenizer_object=raw_tokenizer(family), **FAMILIES[family]["config"])
        tok.chat_template = template(family)
        fmt = JinjaChatFormat(template(family), tok.special_tokens_map, TEMPLATE_KWARGS.get(family))
        for name, record in ROWS.items():
            messages, tools = openai_conversation(fmt, parse_row(record, f"{name}:1"))
            kw = TEMPLATE_KWARGS.get(family, {})
            try:
                full = tok.apply_chat_template(messages, tools=tools, tokenize=False, **kw)
                prompt = tok.apply_chat_template(messages[:-1], tools=tools, tokenize=False,
                                                 add_generation_prompt=True, **kw)  # fmt: skip
                golden[f"{family}/{name}"] = {"prompt": prompt, "full": full}
            except Exception as exc:  # noqa: BLE001  (the template's own refusal is the expected output)
                golden[f"{family}/{name}"] = {"error": str(exc)}
    return golden


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    GOLDEN.write_text(json.dumps(make_golden(), indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {GOLDEN}")
