"""A conversation's assistant turns, each with the true history before it, and the prompt of a turn.

Evaluation scores every assistant turn of a held-out conversation (issue 21): the model continues
from the reference history up to that turn (the user's messages, earlier assistant turns and
tool results as the data has them, not the model's own earlier output), and its answer is
compared with the turn's. Serving builds the same prompt for the turn a client asks for.

:func:`expand_turns` gives one :class:`Turn` per assistant message of each conversation row (a
query/answers row is one turn, kept as it is, so single-turn figures do not move);
:func:`conversation_prompt` gives the ids a format encodes before a row's last assistant turn.

    turns = expand_turns(rows)
    ids = [conversation_prompt(fmt, t.row, tok) for t in turns if t.row.messages is not None]
    turns[0].kind            # "calls" | "text" | "offtopic"
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from needle.data.conversation import assistant_turns, derived_fields
from needle.data.schema import Row
from needle.tokenizers.base import TokenizerLike


@dataclass(frozen=True)
class Turn:
    """One assistant turn to predict: ``row`` ends with it (its ``answers`` are the turn's calls)."""

    row: Row  # the conversation up to and including this turn; a query/answers row as is
    conversation: int  # index of the row it came from in the evaluated rows
    message: int  # index of the assistant message in the conversation (row_messages order)
    text: str | None  # the reference answer in words when the turn answers without calls

    @property
    def kind(self) -> str:
        """``calls`` (the turn calls tools), ``text`` (answers in words) or ``offtopic`` (neither)."""
        if self.row.answers:
            return "calls"
        return "text" if self.text else "offtopic"


def expand_turns(rows: Sequence[Row]) -> list[Turn]:
    """Every assistant turn of every row, in order; a query/answers row is its single turn."""
    out: list[Turn] = []
    for c, row in enumerate(rows):
        if row.messages is None:
            out.append(Turn(row, c, 2 if row.system else 1, None))
            continue
        for i in assistant_turns(row.messages):
            msgs = row.messages[: i + 1]
            query, answers, reasoning, system = derived_fields(msgs)
            turn_row = replace(row, query=query, answers=answers, reasoning=reasoning, system=system, messages=msgs)
            text = (msgs[-1].get("content") or "").strip() if not answers else None
            out.append(Turn(turn_row, c, i, text or None))
    return out


def conversation_prompt(fmt: Any, row: Row, tok: TokenizerLike) -> list[int]:
    """The ids before the last assistant turn of ``row`` as ``fmt.encode_conversation`` encodes it."""
    encode = getattr(fmt, "encode_conversation", None)
    if encode is None:
        raise ValueError(f"{fmt!r} cannot render conversations")
    ex = encode(row, tok, sys.maxsize, loss_on="last_assistant")
    end = len(ex.loss_mask)
    while end and not ex.loss_mask[end - 1]:
        end -= 1
    start = end
    while start and ex.loss_mask[start - 1]:
        start -= 1
    if start == end:
        raise ValueError(f"{fmt!r}: the conversation's last assistant turn encodes to no tokens")
    return list(ex.ids[:start])
