"""Needle 3's tokenizer, row format, parser and call grammar against cactus-needle 3.2.8's own code.

The fixtures (tests/fixtures/needle3_format/) were written by the reference package itself
(tests/data/make_needle3_format_fixtures.py, run in the side virtualenv): two small stand-in
SentencePiece models with Needle's fixed special ids, and what the reference's tokenizer,
``render_example``, ``_encode`` and ``_calls_of`` gave on them.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import jsonschema
import numpy as np
import pytest

from needle.data.chat import format_for
from needle.data.needle3_format import FORMAT_ID, Needle3Format, render_example
from needle.data.parse import parse_needle3, parser_for
from needle.data.render import NativeFormat, encode_prompts
from needle.data.schema import Row, parse_row
from needle.eval.constrain import CLOSE_RESERVE, BatchMasks, Constraints, arguments_schema, grammar_for
from needle.tokenizers.base import SP_MODEL_FILE, TokenizerLike
from needle.tokenizers.load import load_tokenizer
from needle.tokenizers.markers import MARKERS
from needle.tokenizers.needle3 import Needle3Tokenizer

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "needle3_format"
CASES = json.loads((FIXTURES / "cases.json").read_text(encoding="utf-8"))
MODELS = sorted(CASES["tokenizers"])  # tokenizer (dummy prefix, whitespace kept), tokenizer_nodummy


@pytest.fixture(scope="module", params=MODELS)
def model(request: pytest.FixtureRequest) -> tuple[Needle3Tokenizer, dict[str, Any]]:
    name = request.param
    return Needle3Tokenizer.load(FIXTURES / f"{name}.model"), CASES["tokenizers"][name]


@pytest.fixture(scope="module")
def tok() -> Needle3Tokenizer:
    return Needle3Tokenizer.load(FIXTURES / SP_MODEL_FILE)


def _rows(cases: dict[str, Any]) -> list[tuple[Row, dict[str, Any]]]:
    return [(parse_row(c["example"], f"case:{i}"), c) for i, c in enumerate(cases["render"]) if c["row_equivalent"]]


# --- tokenizer -------------------------------------------------------------------------------
def test_encode_and_decode_give_the_reference_ids_and_text(model) -> None:
    tok, cases = model
    assert tok.vocab_size == cases["vocab_size"]
    for case in cases["encode"]:
        assert tok.encode(case["text"]) == case["ids"], case["text"]
        assert tok.decode(case["ids"]) == case["decoded"], case["text"]
    assert tok.encode_batch([c["text"] for c in cases["encode"]]) == [c["ids"] for c in cases["encode"]]
    for case in cases["decode"]:
        assert tok.decode(case["ids"]) == case["text"]


def test_every_marker_has_its_fixed_id_and_the_turn_end_stops(tok: Needle3Tokenizer) -> None:
    assert isinstance(tok, TokenizerLike)
    assert (tok.pad_id, tok.eos_id, tok.bos_id, tok.unk_id) == (0, 1, 2, 3)
    assert [tok.token_id(m) for m in MARKERS] == list(range(4, 4 + len(MARKERS)))
    assert tok.token_id("<|im_end|>") == tok.end_id == 5 and tok.stop_ids == (5, 1)
    assert tok.encode("".join(MARKERS))[-len(MARKERS) :] == list(range(4, 20))
    # Control pieces are never made from text, and write nothing when decoded.
    assert not {0, 1, 2, 3} & set(tok.encode("<s></s><pad><unk>"))
    assert tok.decode([2, 1, 0]) == ""
    assert tok.decode([4, 10, 5], skip_special=True) == ""
    assert tok.decode([10, 10_000]) == "<tool_call>"  # ids past the vocabulary (a padded head) are dropped
    with pytest.raises(KeyError):
        tok.token_id("<not a piece>")
    assert tok.chat_template is None and isinstance(format_for(tok), Needle3Format)


def test_save_writes_the_model_file_and_load_tokenizer_finds_it(tok: Needle3Tokenizer, tmp_path: Path) -> None:
    out = tok.save(tmp_path / "m")
    assert out == tmp_path / "m" / SP_MODEL_FILE
    assert out.read_bytes() == (FIXTURES / SP_MODEL_FILE).read_bytes()
    for where in (tmp_path / "m", out):
        again = load_tokenizer(where)
        assert isinstance(again, Needle3Tokenizer) and again == tok
    # The hub layout: <snapshot>/tokenizer/tokenizer.model
    tok.save(tmp_path / "snap" / "tokenizer")
    assert Needle3Tokenizer.load(tmp_path / "snap") == tok
    assert tok.to_json() == load_tokenizer(out).to_json()
    other = Needle3Tokenizer.load(FIXTURES / "tokenizer_nodummy.model")
    assert other.to_json() != tok.to_json() and other != tok


def test_a_model_without_needles_ids_or_not_sentencepiece_is_refused(tok: Needle3Tokenizer, tmp_path: Path) -> None:
    from sentencepiece import sentencepiece_model_pb2 as pb

    proto = pb.ModelProto()
    proto.ParseFromString(tok.model_bytes)
    proto.pieces[5].piece = "<|end|>"  # <|im_end|> moved away from id 5
    with pytest.raises(ValueError, match="im_end"):
        Needle3Tokenizer(proto.SerializeToString())
    (tmp_path / SP_MODEL_FILE).write_bytes(b"not a model")
    with pytest.raises(ValueError, match=SP_MODEL_FILE):
        load_tokenizer(tmp_path)
    with pytest.raises(FileNotFoundError):
        Needle3Tokenizer.load(tmp_path / "missing")


def test_the_grammar_sees_the_bytes_decode_writes(model) -> None:
    tok, cases = model
    raw = tok.token_bytes()
    assert len(raw) == tok.vocab_size
    assert raw[tok.token_id("<0x41>")] == b"A" and raw[10] == b"\xff<tool_call>" and raw[1] == b"\xff</s>"
    for case in cases["encode"]:
        joined = b"".join(raw[i].removeprefix(b"\xff") for i in case["ids"]).decode("utf-8", "replace")
        if tok.add_dummy_prefix and joined.startswith(" "):
            joined = joined[1:]  # what decode drops: the dummy prefix
        elif not tok.add_dummy_prefix:
            joined = joined.lstrip(" ")  # remove_extra_whitespaces: decode drops every leading space
        assert joined == case["decoded"], case["text"]


# --- row format ------------------------------------------------------------------------------
def test_render_example_is_the_references_byte_for_byte(model) -> None:
    _, cases = model
    for case in cases["render"]:
        assert render_example(case["example"]) == (case["prompt"], case["target"])


def test_rows_encode_to_the_references_ids_and_loss_mask(model) -> None:
    tok, cases = model
    fmt = Needle3Format()
    rows = _rows(cases)
    assert len(rows) >= 7
    for row, case in rows:
        assert (fmt.render_prompt(row), fmt.render_target(row)) == (case["prompt"], case["target"])
        ex = fmt.encode_example(row, tok, max_len=4096)
        assert ex.ids == case["ids"] and not ex.truncated, row.source
        assert ex.loss_mask == [int(m) for m in case["mask"]]
        assert ex.ids[0] == 2 and ex.ids[-1] == 1 and ex.loss_mask[-1] == 1 and set(case["padded_tail"]) == {0}
        prompt = fmt.encode_prompt(row, tok)
        assert encode_prompts(fmt, [row], tok) == [prompt]
        assert ex.ids[: len(prompt)] == prompt and not any(ex.loss_mask[: len(prompt)])
        assert all(ex.loss_mask[len(prompt) :])


def test_an_over_long_row_is_flagged_not_cut_silently(model) -> None:
    tok, cases = model
    for row, case in _rows(cases):
        ex = Needle3Format().encode_example(row, tok, max_len=case["max_len_cut"])
        # The same first tokens the reference keeps, but flagged: prepare refuses or drops the row.
        assert ex.truncated and ex.ids == case["cut_ids"] and ex.loss_mask == [int(m) for m in case["cut_mask"]]


def test_the_format_has_its_own_id_and_refuses_other_tokenizers() -> None:
    fmt = Needle3Format()
    assert fmt.template_id().startswith(f"{FORMAT_ID}:") and fmt.template_id() != NativeFormat().template_id()
    row, _ = _rows(CASES["tokenizers"]["tokenizer"])[0]
    native_ids = SimpleNamespace(bos_id=1, eos_id=2, encode=lambda text: [9])  # needle's BPE numbers them so
    with pytest.raises(ValueError, match="Needle 3 tokenizer"):
        fmt.encode_example(row, native_ids, 4096)


# --- parser ----------------------------------------------------------------------------------
def test_parser_for_needle3_and_agreement_with_the_reference_scorer() -> None:
    assert parser_for("needle3") is parse_needle3 and parser_for(Needle3Format().template_id()) is parse_needle3
    for case in CASES["calls_of"]:
        parsed = parse_needle3(case["text"])
        if parsed.ok:
            got = [[c["name"], json.dumps(c["arguments"], sort_keys=True)] for c in parsed.calls]
            assert got == case["calls"], case["text"]
        else:
            # The reference's scorer is lenient (no block = []); needle counts these as malformed.
            assert case["calls"] in (None, []), case["text"]
    assert sum(parse_needle3(c["text"]).ok for c in CASES["calls_of"]) == 3


def test_targets_parse_back_to_the_rows_answers_and_reasoning(model) -> None:
    _, cases = model
    fmt = Needle3Format()
    for row, _ in _rows(cases):
        target = fmt.render_target(row)
        for text in (target, " " + target, target.removesuffix("<|im_end|>")):
            parsed = fmt.parse(text)
            assert parsed.ok and parsed.calls == row.answers, (text, parsed.error)
            assert parsed.reasoning == ((row.reasoning or "").strip() or None)


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("", "<tool_call> missing"),
        ("I cannot help with that.", "<tool_call> missing"),
        ('sure <tool_call>[]</tool_call>', "preceded by other text"),
        ("<think>\nhmm", "no </think>"),
        ('<tool_call>[{"name":"f","arguments":{}}]', "no </tool_call>"),
        ("<tool_call>[]</tool_call> and more", "text after </tool_call>"),
        ("<tool_call></tool_call>", "nothing inside"),
        ('<tool_call>[{"name":"f","arguments":{</tool_call>', "invalid JSON"),
        ('<tool_call>[{"name":"f","arguments":{"a":"<tools>"}}]</tool_call>', "special token"),
        ('<tool_call>{"name":"f","arguments":{}}</tool_call>', "not a list"),
        ('<tool_call>[{"name":"f"}]</tool_call>', "no 'arguments'"),
        ('<tool_call>[{"name":"f","arguments":[]}]</tool_call>', "not an object"),
        ('<tool_call>[{"name":"f","arguments":{},"id":1}]</tool_call>', "unexpected keys"),
        ("<tool_call>[] []</tool_call>", "text after the JSON"),
        (None, "expected text"),
    ],
)
def test_malformed_output_is_an_error_not_a_crash(text: Any, error: str) -> None:
    parsed = parse_needle3(text)
    assert parsed.calls is None and error in parsed.error


# --- constrained decoding --------------------------------------------------------------------
def test_the_grammar_accepts_the_reference_targets(model) -> None:
    tok, cases = model
    cons = Constraints.for_tokenizer(tok, Needle3Format())
    assert cons.kind == "needle3" and cons.stop_ids == (5, 1)
    assert "<[10]>" in cons.grammar([]) and "<[11]>" in cons.grammar([])
    for row, case in _rows(cases):
        if row.reasoning and row.reasoning.strip():
            continue  # constrained rows answer without a <think> block
        ids = case["ids"]
        target = ids[len(Needle3Format().encode_prompt(row, tok)) : -2]  # up to </tool_call>: no <|im_end|>, eos
        m = cons.matcher(row.tools)
        assert m.consume_tokens(target), (row.source, m.get_error())
        assert m.is_accepting()
    assert cons.matcher(rows_tools := _rows(cases)[0][0].tools).consume_tokens(tok.encode("<tool_call>[]</tool_call>"))
    bad = cons.matcher(rows_tools)
    assert not bad.consume_tokens(tok.encode('<tool_call>[{"name":"nope","arguments":{}}]</tool_call>'))
    assert "</tool_call>" in grammar_for("needle3", rows_tools)


def _random_decode(cons: Constraints, rows: list[Row], vocab: int, max_new: int, seed: int) -> list[list[int]]:
    """Greedy decoding of random logits under the masks, as needle/eval/decode.py steps them."""
    rng = np.random.default_rng(seed)
    masks = BatchMasks([cons.matcher(r.tools) for r in rows], cons.tok_vocab, vocab, list(cons.stop_ids))
    scores = cons.close_scores(vocab)
    token_bytes = cons.token_bytes()
    out: list[list[int]] = [[] for _ in rows]
    done = np.zeros(len(rows), bool)
    idx = np.arange(vocab)
    for step in range(max_new):
        allowed = ((masks.bits[:, idx // 32] >> (idx % 32)) & 1).astype(bool)
        logits = rng.normal(size=(len(rows), vocab)) * 3.0
        if max_new - step <= CLOSE_RESERVE:
            logits += np.where(masks.in_string[:, None], scores[1], scores[0]) * 1e5
        nxt = np.argmax(np.where(allowed, logits, -np.inf), axis=-1)
        for i in np.flatnonzero(~done):
            out[i].append(int(nxt[i]))
        done_now = done | np.isin(nxt, cons.stop_ids)
        if done_now.all():
            break
        masks.update(nxt, done_now, token_bytes)
        done = done_now
    return out


def test_random_logits_under_the_grammar_write_only_valid_calls_to_offered_tools(model) -> None:
    tok, cases = model
    cons = Constraints.for_tokenizer(tok, Needle3Format())
    rows = [r for r, _ in _rows(cases)]
    rows.append(Row("nothing to offer", [], [], None, None, "no-tools"))
    vocab = tok.vocab_size + 16  # a padded model head: ids past the tokenizer stay forbidden
    n_calls = 0
    for seed in range(3):
        for row, ids in zip(rows, _random_decode(cons, rows, vocab, max_new=160, seed=seed)):
            assert ids[-1] in tok.stop_ids and all(i < tok.vocab_size for i in ids), ids
            text = tok.decode(ids)
            parsed = Needle3Format().parse(text)
            assert parsed.ok, (text, parsed.error)
            by_name = {t["name"]: t for t in row.tools}
            for call in parsed.calls:
                assert call["name"] in by_name, text
                jsonschema.validate(call["arguments"], arguments_schema(by_name[call["name"]]))
                n_calls += 1
    assert n_calls > 0  # not only empty lists


def test_a_tokenizer_with_sentencepieces_default_normaliser_decodes_valid_calls_too(tmp_path: Path) -> None:
    """NFKC and whitespace folding (sentencepiece's defaults, the benchmark's stand-in): trained here."""
    import io

    import sentencepiece as spm

    cases = CASES["tokenizers"]["tokenizer"]["render"]
    texts = [c["prompt"] + c["target"] for c in cases] * 4
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts), model_writer=buf, vocab_size=400, model_type="bpe", pad_id=0, eos_id=1,
        bos_id=2, unk_id=3, user_defined_symbols=list(MARKERS), byte_fallback=True, hard_vocab_limit=False,
        character_coverage=1.0, minloglevel=2, num_threads=1,
    )  # fmt: skip
    tok = Needle3Tokenizer(buf.getvalue())
    tok.save(tmp_path)
    assert load_tokenizer(tmp_path) == tok
    cons = Constraints.for_tokenizer(tok, Needle3Format())
    rows = [r for r, _ in _rows(CASES["tokenizers"]["tokenizer"])]
    for row, ids in zip(rows, _random_decode(cons, rows, tok.vocab_size, max_new=120, seed=7)):
        parsed = parse_needle3(tok.decode(ids))
        assert parsed.ok, (tok.decode(ids), parsed.error)
        assert {c["name"] for c in parsed.calls} <= {t["name"] for t in row.tools}
