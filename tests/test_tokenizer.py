"""Byte-level BPE tokenizer: exact round trip, special tokens, persistence, determinism."""

from __future__ import annotations

import json

import pytest

from needle.tokenizers.base import SPECIAL_TOKENS
from needle.tokenizers.native import Tokenizer, train_tokenizer

CORPUS = [
    '<|bos|><|user|>Set a timer for 5 minutes<|end|><|assistant|><|call|>[{"name":"set_timer"}]<|end|>',
    "Turn on the kitchen lights and play some jazz",
    "What's the weather in Zürich? Il fait très beau à Paris.",
    "東京の天気は？ 🎉🚀 emoji and CJK text",
] * 20
ROUND_TRIP = [
    "",
    "plain ascii",
    "  two leading spaces",
    " one leading space",
    "trailing space ",
    "new\nlines\r\n\ttabs\n\n",
    "café naïve façade Ångström",
    "東京 北京 서울",
    "emoji 👩‍👩‍👧 🎉 and a flag 🇯🇵",
    "text never seen in training: Qxzv §¶ ∑∂ \x00\x7f",
    "<|bos|><|system|>special<|end|> tokens <|call|>[]<|end|>",
    "<|not_special|> <|end",
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return train_tokenizer(CORPUS, vocab_size=400)


@pytest.mark.parametrize("text", ROUND_TRIP)
def test_decode_inverts_encode_exactly(tok: Tokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text)) == text


def test_special_tokens_take_ids_0_to_8_in_order(tok: Tokenizer) -> None:
    assert [tok.token_id(t) for t in SPECIAL_TOKENS] == list(range(9))
    assert (tok.pad_id, tok.bos_id, tok.end_id) == (0, 1, 2)
    assert tok.vocab_size == 400


def test_special_tokens_in_text_become_single_ids(tok: Tokenizer) -> None:
    ids = tok.encode("<|bos|>hi<|end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.decode(ids, skip_special=True) == "hi"
    assert tok.decode([tok.token_id("<|call|>")]) == "<|call|>"


def test_unknown_token_raises(tok: Tokenizer) -> None:
    with pytest.raises(KeyError):
        tok.token_id("<|nope|>")


def test_save_and_load_are_json_and_equal(tok: Tokenizer, tmp_path) -> None:
    path = tok.save(tmp_path / "tok")
    assert path.name == "tokenizer.json"
    json.loads(path.read_text(encoding="utf-8"))  # plain JSON, no pickle
    for where in (tmp_path / "tok", path):
        loaded = Tokenizer.load(where)
        assert loaded == tok
        assert loaded.encode(CORPUS[2]) == tok.encode(CORPUS[2])


def test_load_missing_file_names_the_path(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.load(tmp_path)


def test_training_is_deterministic_and_data_dependent() -> None:
    a = train_tokenizer(CORPUS, vocab_size=400)
    b = train_tokenizer(CORPUS, vocab_size=400)
    c = train_tokenizer(CORPUS[:2] * 40, vocab_size=400)
    assert a.to_json() == b.to_json()
    assert a.to_json() != c.to_json()


def test_merges_compress_training_text(tok: Tokenizer) -> None:
    text = CORPUS[1]
    assert len(tok.encode(text)) < len(text) / 3


def test_vocab_too_small_is_rejected() -> None:
    with pytest.raises(ValueError, match="must exceed 265"):
        train_tokenizer(CORPUS, vocab_size=265)


def test_wrapper_rejects_tokenizer_without_specials_at_fixed_ids() -> None:
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models

    hf = HFTokenizer(models.BPE())
    hf.add_special_tokens(["<|bos|>", "<|pad|>"])
    with pytest.raises(ValueError, match="<\\|pad\\|> has id 1, expected 0"):
        Tokenizer(hf)


def test_load_tokenizer_picks_the_native_one_and_keeps_its_bytes(tmp_path) -> None:
    from needle.tokenizers.base import TokenizerLike
    from needle.tokenizers.load import load_tokenizer

    tok = train_tokenizer(CORPUS, vocab_size=300)
    path = tok.save(tmp_path)
    back = load_tokenizer(path)  # the file or its directory
    assert type(back) is Tokenizer and back == tok and back.to_json() == path.read_text(encoding="utf-8")
    assert isinstance(back, TokenizerLike) and back.stop_ids == (back.end_id,) and back.chat_template is None
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        load_tokenizer(tmp_path / "missing")
