"""predict / run_predict_cli round trips through a tiny saved model; bad input is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import needle.serve.predict as predict_mod
import needle.serve.engine as engine
from needle.config import EvalConfig
from needle.data.render import render_prompt
from needle.data.schema import Row
from needle.eval.decode import Generation, generate
from needle.model.io import load_model
from needle.model.decoder.transformer import Transformer

QUERIES = ["what time is it in Oslo", "hello there"]


@pytest.fixture
def tools_file(eval_rows: list[Row], tmp_path: Path) -> Path:
    path = tmp_path / "tools.json"
    path.write_text(json.dumps(eval_rows[0].tools), encoding="utf-8")
    return path


def test_cli_prints_one_json_line_per_query_matching_the_decoder(
    tiny_model_dir: Path, tools_file: Path, eval_rows: list[Row], capsys: pytest.CaptureFixture
) -> None:
    # --free: exactly the free decoder's output (the constrained default is tests/serve/).
    assert predict_mod.run_predict_cli(str(tiny_model_dir), str(tools_file), QUERIES, constrained=False) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    loaded = load_model(tiny_model_dir)
    tok = loaded.tokenizer
    prompts = [
        tok.encode(render_prompt(Row(q, eval_rows[0].tools, [], None, None, "q"))) for q in QUERIES
    ]
    cfg = EvalConfig()
    expected = generate(
        Transformer(loaded.model_cfg), loaded.params, prompts,
        max_new_tokens=cfg.max_new_tokens, end_id=tok.end_id, pad_id=tok.pad_id, batch_size=cfg.batch_size,
    )  # fmt: skip
    for line, ids in zip(lines, expected):
        out = json.loads(line)
        # An untrained model emits junk: the line is an error object carrying the raw text.
        assert isinstance(out, dict) and set(out) == {"error", "raw"}
        assert out["raw"] == tok.decode(ids)


def test_parsed_calls_and_unfinished_outputs(monkeypatch, tiny_model_dir: Path, eval_rows: list[Row]) -> None:
    loaded = load_model(tiny_model_dir)
    tok = loaded.tokenizer
    call = '<|call|>[{"name":"get_time","arguments":{"city":"Oslo"}}]'
    scripted = Generation([tok.encode(call), tok.encode("<|call|>[{")], [True, False], 20)
    monkeypatch.setattr(engine, "generate_detailed", lambda *a, **k: scripted)
    out = predict_mod.predict(loaded, eval_rows[0].tools, QUERIES, EvalConfig(max_new_tokens=16), constrained=False)
    assert out[0] == [{"name": "get_time", "arguments": {"city": "Oslo"}}]
    assert out[1]["raw"] == "<|call|>[{" and "no <|end|> within 16 tokens" in out[1]["error"]


def test_bad_tools_files_exit_2_with_the_reason(tiny_model_dir: Path, tmp_path: Path, capsys) -> None:
    broken = tmp_path / "broken.json"
    broken.write_text('[{"name": "f",\n', encoding="utf-8")
    assert predict_mod.run_predict_cli(str(tiny_model_dir), str(broken), QUERIES) == 2
    assert f"{broken}:2: invalid JSON" in capsys.readouterr().err
    nameless = tmp_path / "nameless.json"
    nameless.write_text('[{"description": "x"}]', encoding="utf-8")
    assert predict_mod.run_predict_cli(str(tiny_model_dir), str(nameless), QUERIES) == 2
    assert "invalid tools: tools[0] needs a non-empty string 'name'" in capsys.readouterr().err
    assert predict_mod.run_predict_cli(str(tiny_model_dir), str(tmp_path / "missing.json"), QUERIES) == 2
    assert "no such tools file" in capsys.readouterr().err


def test_run_evaluate_cli_writes_the_report(tiny_model_dir: Path, sample_data: dict, tmp_path: Path, capsys) -> None:
    out_dir = tmp_path / "report"
    assert predict_mod.run_evaluate_cli(str(tiny_model_dir), str(sample_data["new"]), str(out_dir), 2) == 0
    printed = capsys.readouterr().out
    assert "| exact_match" in printed and "2 rows in" in printed and "rows/s constrained" in printed
    assert "| free |" in printed.replace("  ", " ") or "free" in printed.splitlines()[0]
    metrics = json.loads((out_dir / "metrics.json").read_text())
    assert metrics["n"] == 2 and metrics["constrained_valid_call_rate"] is not None
    assert len((out_dir / "examples.jsonl").read_text().splitlines()) == 2
    assert len((out_dir / "examples_constrained.jsonl").read_text().splitlines()) == 2
