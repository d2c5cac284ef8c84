"""Models with a pretrained tokenizer and chat template evaluate and predict through the same code.

A tiny random needle model stands in for an imported one (the model itself is not what is
tested); its tokenizer is a Qwen3-style HF tokenizer directory built offline, so prompts are
rendered with the Jinja template, decoding stops at the tokenizer's stop ids and the
``<tool_call>`` answers are parsed by the Hermes parser.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

import needle.eval.evaluate as evaluate_mod
import needle.serve.predict as predict_mod

from needle.config import EvalConfig, model_preset
from needle.data.chat import JinjaChatFormat, format_for
from needle.data.schema import Row
from needle.eval.decode import Generation
from needle.model.factory import LoadedModel
from needle.model.lora import init_params
from needle.tokenizers.load import load_tokenizer

QWEN_TEMPLATE = Path(__file__).parents[2] / "needle" / "data" / "templates" / "qwen3.jinja"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<think>", "</think>"]


@pytest.fixture(scope="module")
def qwen_loaded(tmp_path_factory: pytest.TempPathFactory, eval_rows: list[Row]) -> LoadedModel:
    root = tmp_path_factory.mktemp("qwen_tok")
    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    raw.train_from_iterator([json.dumps(r.__dict__) for r in eval_rows[:200]], trainer=trainer)
    raw.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}))
    (root / "chat_template.jinja").write_text(QWEN_TEMPLATE.read_text(encoding="utf-8"))
    eos = [raw.token_to_id("<|im_end|>"), raw.token_to_id("<|endoftext|>")]
    (root / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    cfg = model_preset("tiny", vocab_size=1024, max_len=1024)
    return LoadedModel(params=init_params(cfg, None, 0), model_cfg=cfg, tokenizer=load_tokenizer(root), meta={})


def _fake_decoder(tok, answers: dict[tuple[int, ...], str], seen: dict):
    def fake(model, params, prompts, **kw) -> Generation:
        seen.update(kw)
        ids = [tok.encode(answers.get(tuple(p), "garbage")) for p in prompts]
        return Generation(ids, [True] * len(ids), sum(len(x) + 1 for x in ids))

    return fake


def test_evaluate_renders_with_the_template_and_parses_tool_call_blocks(
    monkeypatch: pytest.MonkeyPatch, qwen_loaded: LoadedModel, eval_rows: list[Row]
) -> None:
    tok = qwen_loaded.tokenizer
    fmt = format_for(tok)
    assert isinstance(fmt, JinjaChatFormat)
    rows = [r for r in eval_rows if r.answers][:4] + [r for r in eval_rows if not r.answers][:2]
    # The oracle answer is the target up to its end-of-turn token, exactly what decoding returns.
    answers = {tuple(tok.encode(fmt.render_prompt(r))): fmt.render_target(r).split("<|im_end|>")[0] for r in rows}
    seen: dict = {}
    monkeypatch.setattr(evaluate_mod, "generate_detailed", _fake_decoder(tok, answers, seen))
    result = evaluate_mod.evaluate_model(qwen_loaded, rows, EvalConfig(max_new_tokens=64))
    assert seen["end_id"] == tok.stop_ids and len(tok.stop_ids) == 2 and seen["pad_id"] == tok.pad_id
    m = result.metrics
    assert m["exact_match"] == 1.0 and m["parse_rate"] == 1.0 and m["offtopic_accuracy"] == 1.0


def test_predict_parses_tool_calls_and_reports_the_turn_end_by_name(
    monkeypatch: pytest.MonkeyPatch, qwen_loaded: LoadedModel, eval_rows: list[Row]
) -> None:
    tok = qwen_loaded.tokenizer
    call = '<think>\n\n</think>\n\n<tool_call>\n{"name": "get_time", "arguments": {"city": "Oslo"}}\n</tool_call>'
    scripted = Generation([tok.encode(call), tok.encode("<tool_call>\n{")], [True, False], 20)
    monkeypatch.setattr("needle.serve.engine.generate_detailed", lambda *a, **k: scripted)
    out = predict_mod.predict(qwen_loaded, eval_rows[0].tools, ["time in Oslo?", "and?"], EvalConfig(max_new_tokens=16))
    assert out[0] == [{"name": "get_time", "arguments": {"city": "Oslo"}}]
    assert "no <|im_end|> within 16 tokens" in out[1]["error"] and out[1]["raw"] == "<tool_call>\n{"
