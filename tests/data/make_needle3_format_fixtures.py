"""Write tests/fixtures/needle3_format/ with cactus-needle 3.2.8's own tokenizer and row code.

Runs in the side virtualenv that has ``cactus-needle[train]==3.2.8`` and ``sentencepiece``
(its package is also called ``needle``, so this script imports nothing from this repository):

    V=$(.venv/bin/python -c 'from needle.model.needle3.cactus_env import ensure_cactus_env as e; print(e())')
    $V -I tests/data/make_needle3_format_fixtures.py

The published Needle 3 ``tokenizer.model`` lives on the hub, which is unreachable here, so this
trains two small stand-in SentencePiece models with Needle's fixed special ids (pad 0, eos 1,
bos 2, unk 3, the chat markers from 4, as ``bench/cactus_worker.py`` does):

- ``tokenizer.model``: identity normalisation, whitespace kept, dummy prefix, byte fallback
  (what the reference's on-device encoder, ``needle.model.export.RefTokenizer``, implements);
- ``tokenizer_nodummy.model``: no dummy prefix and extra whitespace removed (sentencepiece's
  default), to show nothing depends on one setting (the NFKC normalisers would add 240 kB).

It then records, through the reference's own code (``needle.model.tokenizer.SANTokenizer``,
``needle.model.finetune.render_example`` / ``_encode`` / ``_calls_of``), ``cases.json``: ids and
decoded text of varied strings with every special marker, prompt/target/ids/loss mask of varied
rows, and what the reference's scorer reads out of generated texts. JSON and model files only.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "tests" / "fixtures" / "needle3_format"
N_CORPUS_ROWS = 300  # rows of each sample file the stand-in tokenizers are trained on

TOOLS = [
    {"name": "get_weather", "description": "Current weather for a city",
     "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                     "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                    "required": ["city"]}},
    {"name": "set_timer", "description": "Start a timer",
     "parameters": {"type": "object", "properties": {"minutes": {"type": "integer"}, "label": {"type": "string"}},
                    "required": ["minutes"]}},
    {"name": "convert_currency", "description": "Convert money between currencies",
     "parameters": {"type": "object", "properties": {"amount": {"type": "number"},
                                                     "to_currency": {"type": "string", "enum": ["USD", "EUR", "JPY"]},
                                                     "urgent": {"type": "boolean"}},
                    "required": ["amount", "to_currency"]}},
]


def _rows(name: str, n: int) -> list[dict]:
    with open(ROOT / "data" / "sample" / name, encoding="utf-8") as fh:
        return [json.loads(next(fh)) for _ in range(n)]


def train(prefix: Path, vocab_size: int, texts: list[str], **options: object) -> None:
    import sentencepiece as spm
    from needle.model import tokenizer as tk

    spm.SentencePieceTrainer.Train(
        sentence_iterator=iter(texts), model_prefix=str(prefix), vocab_size=vocab_size, model_type="bpe",
        pad_id=tk.PAD_ID, eos_id=tk.EOS_ID, bos_id=tk.BOS_ID, unk_id=tk.UNK_ID,
        user_defined_symbols=tk.CHAT_MARKERS, byte_fallback=True, hard_vocab_limit=False,
        character_coverage=1.0, minloglevel=2, num_threads=1, **options,
    )
    os.remove(str(prefix) + ".vocab")  # the .vocab listing is not needed: the .model holds everything


def token_texts() -> list[str]:
    from needle.model import tokenizer as tk

    markers = "".join(tk.CHAT_MARKERS)
    return [
        "", " ", "  ", "\n", "\t", "a", " a", "a ", "hello world", "  two  spaces  ", "line one\nline two\n\n",
        markers, " ".join(tk.CHAT_MARKERS), "\n".join(tk.CHAT_MARKERS),
        "<|im_start|>user\nWhat's the weather?<|im_end|>\n<|im_start|>assistant\n",
        "x<tool_call>[]</tool_call>y", "<think>\nreason\n</think>\n<tool_call>",
        "<tool_call", "tool_call>", "<|im_start|", "< tool_call>", "<<tool_call>>", "<tool_call><tool_call>",
        "<s></s><pad><unk>", "<0x41>", "▁", "▁▁x",
        'Set a timer for 25 minutes named "tea"', "Convert 472.18 EUR to JPY, K73019",
        "héllo naïve café", "東京の天気", "emoji 🎉👍🏽 ok", "Ｆｕｌｌｗｉｄｔｈ ①②③ ﬁ", "tab\there\r\nend",
        '{"name":"get_weather","arguments":{"city":"Paris"}}',
        "<tools>" + json.dumps(TOOLS, separators=(",", ":"), ensure_ascii=False) + "</tools>",
        "\u0000\u0001 control \u007f", "trailing newline\n", "  leading", "a\u00a0b\u2009c",
    ]


def render_examples() -> list[dict]:
    """Raw examples (the reference's input dicts) and whether needle's Row form renders the same."""
    compact = json.dumps(TOOLS[:2], separators=(",", ":"), ensure_ascii=False)

    def weather(city: str, **more: str) -> dict:
        return {"name": "get_weather", "arguments": {"city": city, **more}}

    timer = {"name": "set_timer", "arguments": {"minutes": 25, "label": "tea"}}
    convert = {"name": "convert_currency", "arguments": {"amount": 472.18, "to_currency": "JPY", "urgent": True}}
    rome = json.dumps([weather("Rome")], separators=(",", ":"))
    rows = [
        # (example, row_equivalent): needle parses rows (Row) and re-serialises tools compactly.
        ({"query": "What's the weather in Paris in celsius?", "tools": TOOLS,
          "answers": [weather("Paris", unit="celsius")]}, True),
        ({"query": "Set a timer for 25 minutes called tea, then weather in Oslo", "tools": TOOLS,
          "answers": [timer, weather("Oslo")]}, True),
        ({"query": "Tell me a joke", "tools": TOOLS, "answers": []}, True),
        ({"query": "Weather in Zürich?", "tools": TOOLS, "answers": [weather("Zürich")],
          "system": "  You are a helpful assistant.\n", "reasoning": "\n The user names Zürich. \n"}, True),
        ({"query": "Convert 472.18 EUR to JPY urgently", "tools": TOOLS, "answers": [convert],
          "reasoning": "amount 472.18, target JPY"}, True),
        ({"query": "東京の天気は？ 🎉", "tools": TOOLS, "answers": [weather("東京")], "system": "Answer briefly."}, True),
        ({"query": "weather in Rome", "tools": compact, "answers": rome, "reasoning": "   ", "system": ""}, True),
        # A JSON string with spaces: the reference keeps it verbatim, needle re-serialises it.
        ({"query": "weather in Rome", "tools": json.dumps(TOOLS[:1]), "answers": [weather("Rome")]}, False),
        ({"query": "timer 5 min", "tools": TOOLS[1:2],
          "function_calls": [{"name": "set_timer", "arguments": {"minutes": 5}}]}, False),
        ({"query": "  spaced  query with <tool_call> inside\n", "tools": TOOLS[:1], "answers": []}, True),
    ]
    return [{"example": ex, "row_equivalent": same} for ex, same in rows]


def main() -> int:
    from importlib.metadata import version

    from needle.model import finetune as ft
    from needle.model import tokenizer as tk

    OUT.mkdir(parents=True, exist_ok=True)
    corpus = []
    for example in _rows("base.jsonl", N_CORPUS_ROWS) + _rows("new.jsonl", N_CORPUS_ROWS):
        prompt, target = ft.render_example(example)
        corpus.append(prompt + target)
    corpus += [ex["example"]["query"] for ex in render_examples()]
    train(OUT / "tokenizer", 640, corpus, normalization_rule_name="identity", remove_extra_whitespaces=False,
          add_dummy_prefix=True, split_digits=True)
    train(OUT / "tokenizer_nodummy", 400, corpus, normalization_rule_name="identity", add_dummy_prefix=False)

    cases: dict = {"package_version": version("cactus-needle"), "tokenizers": {}}
    for name in ("tokenizer", "tokenizer_nodummy"):
        tok = tk.SANTokenizer(str(OUT / f"{name}.model"))
        assert tok.piece_id(tk.IM_START) == tk.IM_START_ID and tok.piece_id(tk.TOOL_RESULT_END) == tk.TOOL_RESULT_END_ID
        encoded = [{"text": t, "ids": tok.encode(t), "decoded": tok.decode(tok.encode(t))} for t in token_texts()]
        id_lists = [[tk.BOS_ID, tk.IM_START_ID, 50, 60, tk.IM_END_ID, tk.EOS_ID, tk.PAD_ID],
                    list(range(tok.vocab_size)), [tk.UNK_ID], list(range(20, 300))]
        decoded = [{"ids": ids, "text": tok.decode(ids)} for ids in id_lists]
        renders = []
        for case in render_examples():
            ex = case["example"]
            prompt, target = ft.render_example(ex)
            n = 1 + len(tok.encode(prompt)) + len(tok.encode(target)) + 1
            ids, mask = ft._encode(tok, ex, n + 3)  # three pads: the reference pads to max_len
            short_ids, short_mask = ft._encode(tok, ex, n // 2)  # the reference truncates silently
            renders.append({**case, "prompt": prompt, "target": target, "ids": ids[:n], "mask": mask[:n],
                            "padded_tail": ids[n:], "max_len_cut": n // 2,
                            "cut_ids": short_ids, "cut_mask": short_mask})
        cases["tokenizers"][name] = {"vocab_size": tok.vocab_size, "encode": encoded,
                                     "decode": decoded, "render": renders}
    generated = [
        '<tool_call>[{"name":"get_weather","arguments":{"city":"Paris"}}]</tool_call><|im_end|>',
        "<think>\nthe user wants Paris\n</think>\n<tool_call>[]</tool_call><|im_end|>",
        '<tool_call>[{"name":"a","arguments":{}},{"name":"b","arguments":{"x":[1,2]}}]</tool_call>',
        "I cannot help with that.", '<tool_call>[{"name":"a","arguments":{</tool_call>',
        '<tool_call>{"name":"a"}</tool_call>',
    ]
    cases["calls_of"] = [{"text": t, "calls": ft._calls_of(t)} for t in generated]
    with open(OUT / "cases.json", "w", encoding="utf-8") as fh:
        json.dump(cases, fh, ensure_ascii=False, separators=(",", ":"))
        fh.write("\n")
    print(f"wrote {OUT} (cactus-needle {cases['package_version']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
