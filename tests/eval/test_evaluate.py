"""evaluate_model end to end on a tiny saved model, and with a scripted decoder."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

import needle.eval.evaluate as evaluate_mod
from needle.config import DataConfig, EvalConfig
from needle.data.prepare import prepare_dataset
from needle.data.render import compact_json, render_prompt, render_target
from needle.data.schema import Row
from needle.eval.decode import Generation
from needle.eval.metrics import METRIC_KEYS
from needle.model.io import load_model


def test_random_model_on_a_prepared_split(tiny_model_dir: Path, sample_data: dict, eval_tokenizer) -> None:
    data = prepare_dataset(DataConfig(source=str(sample_data["new"]), max_len=256), eval_tokenizer)
    cfg = EvalConfig(max_rows=4, batch_size=4, max_new_tokens=8)
    result = evaluate_mod.evaluate_model(tiny_model_dir, data.splits["test"], cfg)
    m = result.metrics
    assert set(METRIC_KEYS) | {"val_loss", "perplexity", "n_prompts_truncated", "n_unfinished"} <= set(m)
    assert m["n"] == 4 and len(result.examples) == 4
    # An untrained model spreads its bets: the loss sits near ln(vocab).
    assert abs(m["val_loss"] - math.log(1024)) < 1.0
    assert m["perplexity"] == pytest.approx(math.exp(m["val_loss"]))
    assert m["exact_match"] == 0.0 and result.rows_per_s > 0 and result.wall_s > 0
    first = data.splits["test"][0]
    assert result.examples[0]["query"] == first["query"]
    assert result.examples[0]["expected"] == compact_json(json.loads(first["answers"]))


class ScriptedDecoder:
    """Stands in for generate_detailed: answers each prompt with a scripted assistant turn."""

    def __init__(self, tok, answers: dict[tuple[int, ...], str]) -> None:
        self.tok, self.answers, self.seen = tok, answers, []

    def __call__(self, model, params, prompts, **kw) -> Generation:
        self.seen = prompts
        ids = [self.tok.encode(self.answers.get(tuple(p), "garbage")) for p in prompts]
        return Generation(ids, [True] * len(ids), sum(len(x) + 1 for x in ids))


def _script(monkeypatch: pytest.MonkeyPatch, tok, rows: list[Row], texts: list[str]) -> ScriptedDecoder:
    fake = ScriptedDecoder(tok, {tuple(tok.encode(render_prompt(r))): t for r, t in zip(rows, texts)})
    monkeypatch.setattr(evaluate_mod, "generate_detailed", fake)
    return fake


def test_oracle_answers_score_perfectly(monkeypatch, tiny_model_dir: Path, eval_rows: list[Row]) -> None:
    loaded = load_model(tiny_model_dir)
    rows = eval_rows[:12]
    assert any(not r.answers for r in eval_rows[:40]), "sample should hold off-topic rows"
    rows = rows + [r for r in eval_rows if not r.answers][:2]
    _script(monkeypatch, loaded.tokenizer, rows, [render_target(r).removesuffix("<|end|>") for r in rows])
    result = evaluate_mod.evaluate_model(loaded, rows, EvalConfig(max_new_tokens=64))
    m = result.metrics
    assert m["exact_match"] == 1.0 and m["valid_call_rate"] == 1.0 and m["tool_name_accuracy"] == 1.0
    assert m["arg_f1"] == 1.0 and m["offtopic_accuracy"] == 1.0 and m["offtopic_call_rate"] == 0.0
    assert m["val_loss"] is None and m["perplexity"] is None  # plain rows carry no token ids
    assert all(ex["exact"] and ex["predicted"] == ex["expected"] for ex in result.examples)


def test_malformed_output_is_reported_per_example(monkeypatch, tiny_model_dir: Path, eval_rows: list[Row]) -> None:
    loaded = load_model(tiny_model_dir)
    rows = [r for r in eval_rows if r.answers][:2]
    _script(monkeypatch, loaded.tokenizer, rows, [render_target(rows[0]).removesuffix("<|end|>"), '<|call|>[{"name":'])
    result = evaluate_mod.evaluate_model(loaded, rows, EvalConfig(max_new_tokens=64))
    bad = result.examples[1]
    assert bad["parsed"] is False and bad["valid"] is False and bad["predicted"] == '<|call|>[{"name":'
    assert "invalid JSON" in bad["parse_error"]
    assert result.metrics["exact_match"] == 0.5 and result.metrics["parse_rate"] == 0.5


def test_prompts_filling_the_context_are_cut_and_counted(
    monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Path, eval_rows: list[Row]
) -> None:
    loaded = load_model(tiny_model_dir)
    long = Row(**{**eval_rows[0].__dict__, "query": "word " * 400})
    fake = _script(monkeypatch, loaded.tokenizer, [], [])
    result = evaluate_mod.evaluate_model(loaded, [long, eval_rows[1]], EvalConfig(max_new_tokens=64))
    assert result.metrics["n_prompts_truncated"] == 1
    assert len(fake.seen[0]) == loaded.model_cfg.max_len - 64 and fake.seen[1] == loaded.tokenizer.encode(render_prompt(eval_rows[1]))
