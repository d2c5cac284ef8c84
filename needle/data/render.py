"""The chat template: a validated Row -> prompt/target text -> token ids and loss mask.

    <|bos|><|system|>{system}<|end|><|tools|>{tools JSON}<|end|><|user|>{query}<|end|><|assistant|>
    [<|think|>{reasoning}]<|call|>{answers JSON}<|end|>          <- target: the only loss tokens

JSON is compact (``separators=(",", ":")``, ``ensure_ascii=False``) with keys in the given
order. Bump ``TEMPLATE_VERSION`` on any change: it is part of the data fingerprint.

    ex = encode_example(row, tokenizer, max_len=256)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from needle.data.schema import Row
from needle.tokenizer import Tokenizer

TEMPLATE_VERSION = "1"
DEFAULT_SYSTEM = "Answer by calling the right tools."
# The template itself, also hashed into the fingerprint so an edit here cannot go unnoticed.
TEMPLATE = (
    "<|bos|><|system|>{system}<|end|><|tools|>{tools}<|end|><|user|>{query}<|end|><|assistant|>"
    "||[<|think|>{reasoning}]<|call|>{answers}<|end|>"
)


def compact_json(value: Any) -> str:
    """The template's JSON: no spaces, non-ASCII kept, key order as given."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def format_calls(answers: list[dict[str, Any]]) -> str:
    """The call list exactly as the model must emit it after ``<|call|>``."""
    return compact_json([{"name": a["name"], "arguments": a["arguments"]} for a in answers])


def render_prompt(row: Row) -> str:
    """Everything up to and including ``<|assistant|>``: what the model is given."""
    system = row.system if row.system else DEFAULT_SYSTEM
    return (
        f"<|bos|><|system|>{system}<|end|><|tools|>{compact_json(row.tools)}<|end|>"
        f"<|user|>{row.query}<|end|><|assistant|>"
    )


def render_target(row: Row) -> str:
    """The assistant turn the model learns to produce, ending with ``<|end|>``."""
    think = f"<|think|>{row.reasoning}" if row.reasoning else ""
    return f"{think}<|call|>{format_calls(row.answers)}<|end|>"


def render_text(row: Row) -> str:
    """Prompt and target together (what the tokenizer is trained on)."""
    return render_prompt(row) + render_target(row)


@dataclass(frozen=True)
class Example:
    """Token ids of prompt+target, 1 in ``loss_mask`` on target tokens only."""

    ids: list[int]
    loss_mask: list[int]
    truncated: bool


def encode_example(row: Row, tok: Tokenizer, max_len: int) -> Example:
    """Tokenize one row; rows over ``max_len`` keep their first ``max_len`` tokens.

    Prompt and target are encoded separately so the loss boundary is exact (no BPE merge can
    straddle it: both sides of it are special tokens anyway).
    """
    prompt = tok.encode(render_prompt(row))
    target = tok.encode(render_target(row))
    ids = prompt + target
    mask = [0] * len(prompt) + [1] * len(target)
    truncated = len(ids) > max_len
    return Example(ids[:max_len], mask[:max_len], truncated)
