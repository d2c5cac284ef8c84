"""Metrics of a conversation's turns: answers in words, and whole conversations.

An agent's assistant turn either calls tools (scored by needle/eval/metrics.py as a single-turn
row is) or, after the results came back, answers in words. For the turns that answer in words
(``score_text_turns``):

- ``answers_in_text``: the share of them where the model answered in words too, instead of
  calling a tool again (the loop an agent falls into when it never learns to stop);
- ``text_rouge_l``: the mean ROUGE-L F1 of the model's text against the reference answer, over
  lower-cased word tokens (``\\w+``), the longest common subsequence from rapidfuzz; a turn the
  model answered with calls, or with output neither calls nor text, scores 0.

``conversation_exact_match`` (``score_conversations``): over the conversation rows, the share in
which every turn is right: each calling or off-topic turn an exact match of its calls, each text
turn answered in words. A rate whose denominator is 0 is ``None``.

    score_text_turns([{"reference": "It is 4 C in Oslo.", "content": "4 C in Oslo", "calls": None}])
    rouge_l("4 C in Oslo", "It is 4 C in Oslo.")   # 0.8
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import regex

_WORD = regex.compile(r"\w+")


def words(text: str) -> list[str]:
    """Lower-cased word tokens: what ROUGE-L compares."""
    return _WORD.findall(text.lower())


def rouge_l(prediction: str, reference: str) -> float:
    """ROUGE-L F1 of ``prediction`` against ``reference`` over :func:`words` (1.0 when both are empty)."""
    from rapidfuzz.distance import LCSseq

    pred, ref = words(prediction), words(reference)
    if not pred or not ref:
        return float(pred == ref)
    lcs = LCSseq.similarity(pred, ref)
    if not lcs:
        return 0.0
    precision, recall = lcs / len(pred), lcs / len(ref)
    return 2 * precision * recall / (precision + recall)


def _rate(hits: float, total: int) -> float | None:
    return hits / total if total else None


def score_text_turns(items: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """``n_text_turns``, ``answers_in_text``, ``text_rouge_l`` and ``per_example`` flags
    (``answered_in_text``, ``rouge_l``) for turns whose reference answers in words.

    Each item: ``reference`` (the reference text), ``content`` (the model's text answer, or None
    when it called tools or wrote neither), ``calls`` (its non-empty call list, or None).
    """
    flags = []
    for item in items:
        answered = item.get("content") is not None and not item.get("calls")
        score = rouge_l(item["content"], item["reference"]) if answered else 0.0
        flags.append({"answered_in_text": answered, "rouge_l": score})
    n = len(flags)
    return {
        "n_text_turns": n,
        "answers_in_text": _rate(sum(f["answered_in_text"] for f in flags), n),
        "text_rouge_l": _rate(sum(f["rouge_l"] for f in flags), n),
        "per_example": flags,
    }


def score_conversations(turn_ok: Sequence[tuple[int, bool]]) -> dict[str, Any]:
    """``n_conversations`` and ``conversation_exact_match`` from ``(conversation index, turn right)``
    pairs, one per turn of the conversation rows."""
    right: dict[int, bool] = {}
    for conversation, ok in turn_ok:
        right[conversation] = right.get(conversation, True) and bool(ok)
    return {"n_conversations": len(right), "conversation_exact_match": _rate(sum(right.values()), len(right))}
