"""Constrained decoding: a random tiny model can only write parseable, schema-valid calls to offered tools."""

from __future__ import annotations

import json

import jsonschema
import pytest

from needle.data.parse import parse_calls
from needle.data.render import NativeFormat, render_prompt
from needle.data.schema import Row
from needle.eval.constrain import Constraints, ToolSchemaError, arguments_schema, grammar_for
from needle.eval.decode import generate_detailed
from needle.model.io import load_model
from needle.model.decoder.transformer import Transformer

ENUM_TOOLS = [
    {"name": "set_mode", "description": "Set a mode",
     "parameters": {"type": "object", "properties": {"mode": {"type": "string", "enum": ["heat", "cool"]},
                                                     "on": {"type": "boolean"}}, "required": ["mode"]}},
]  # fmt: skip


def _decode(loaded, rows: list[Row], constrained: bool, max_new: int = 64):
    tok = loaded.tokenizer
    cons = Constraints.for_tokenizer(tok, NativeFormat()) if constrained else None
    gen = generate_detailed(
        Transformer(loaded.model_cfg), loaded.params, tok.encode_batch([render_prompt(r) for r in rows]),
        max_new_tokens=max_new, end_id=tok.stop_ids, pad_id=tok.pad_id, batch_size=8,
        matchers=[cons.matcher(r.tools) for r in rows] if cons else None, constraints=cons,
    )  # fmt: skip
    return gen, [tok.decode(ids) for ids in gen.ids]


def _assert_valid(calls: list, tools: list) -> None:
    by_name = {t["name"]: t for t in tools}
    for call in calls:
        assert call["name"] in by_name, call
        jsonschema.validate(call["arguments"], arguments_schema(by_name[call["name"]]))


def test_random_model_under_constraints_writes_only_valid_calls(tiny_model_dir, eval_rows: list[Row]) -> None:
    loaded = load_model(tiny_model_dir)
    rows = eval_rows[:12] + [Row("set it to cool", ENUM_TOOLS, [], None, None, "enum")]
    gen, texts = _decode(loaded, rows, constrained=True)
    assert all(gen.finished), texts
    for row, text in zip(rows, texts):
        parsed = parse_calls(text)
        assert parsed.ok, (text, parsed.error)
        _assert_valid(parsed.calls, row.tools)
    # The same untrained model decoding freely writes junk: the masks did the work.
    _, free = _decode(loaded, rows, constrained=False)
    assert sum(parse_calls(t).ok for t in free) < len(rows)


def test_free_rows_in_a_constrained_call_are_decoded_as_before(tiny_model_dir, eval_rows: list[Row]) -> None:
    loaded = load_model(tiny_model_dir)
    tok = loaded.tokenizer
    rows = eval_rows[:3]
    prompts = tok.encode_batch([render_prompt(r) for r in rows])
    model = Transformer(loaded.model_cfg)
    cons = Constraints.for_tokenizer(tok, NativeFormat())
    opts = dict(max_new_tokens=24, end_id=tok.stop_ids, pad_id=tok.pad_id, batch_size=4)
    free = generate_detailed(model, loaded.params, prompts, **opts)
    # Rows without a matcher on the host loop give the compiled loop's tokens exactly.
    mixed = generate_detailed(model, loaded.params, prompts, matchers=[None, cons.matcher(rows[1].tools), None],
                              constraints=cons, **opts)  # fmt: skip
    assert mixed.ids[0] == free.ids[0] and mixed.ids[2] == free.ids[2]


def test_grammar_accepts_the_reference_answers_and_caches_per_tool_set(eval_tokenizer, eval_rows: list[Row]) -> None:
    cons = Constraints.for_tokenizer(eval_tokenizer, NativeFormat())
    for row in eval_rows[:20]:
        m = cons.matcher(row.tools)
        target = eval_tokenizer.encode("<|call|>" + json.dumps(row.answers, separators=(",", ":"), ensure_ascii=False))
        assert m.consume_tokens(target), (row.source, m.get_error())
        assert m.is_accepting()
    before = cons.n_compiled
    cons.matcher(eval_rows[0].tools)
    assert cons.n_compiled == before  # cached


def test_bad_schemas_are_errors_not_crashes(eval_tokenizer) -> None:
    cons = Constraints.for_tokenizer(eval_tokenizer, NativeFormat())
    with pytest.raises(ToolSchemaError, match="must be a JSON schema"):
        cons.matcher([{"name": "f", "parameters": {"type": "string"}}])
    with pytest.raises(ToolSchemaError, match="unique"):
        cons.matcher([{"name": "f"}, {"name": "f"}])
    assert "<tool_call>" in grammar_for("hermes", ENUM_TOOLS) and '"parameters"' in grammar_for("llama", ENUM_TOOLS)
