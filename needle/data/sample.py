"""Deterministic synthetic tool-calling data: the bundled sample and test fixtures.

Rows draw on the catalogue of typed tools and their phrasings (needle/data/sample_tools.py). Rows are single calls, two-call requests ("turn on the lights and
set a timer for 5 minutes"), and about 1 in 5 off-topic queries whose answer is ``[]``: a third
chit-chat, two thirds a request for a tool that is not offered (the same phrasings that call
the tool when it is on offer, so the model learns to read the tool list, not only the query). Argument values are copied verbatim from
the query. Every row offers 3-5 tools (the needed ones plus distractors), so the model must
pick. ``BASE_TOOLS`` train the base model; ``NEW_TOOLS`` are held out for fine-tuning.

``new.jsonl`` also ends with conversations over the new tools (needle/data/sample_conversations.py).

    python -m needle.data.sample data/sample        # writes base.jsonl and new.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any, Literal

from needle.data.sample_conversations import generate_conversations
from needle.data.sample_tools import BASE_TOOLS, CATALOGUE, JOINERS, MAX_NEW_OFFERED, NEW_TOOLS, _NEW_NAMES, Tool, fill

Part = Literal["base", "new"]

OFF_TOPIC = (
    "Tell me a joke", "How are you today?", "What is the meaning of life?", "Write a haiku about autumn",
    "Who painted the Mona Lisa?", "Thanks, that's all", "What's your favourite colour?", "Explain black holes simply",
    "hello there", "Can you keep a secret?", "Why is the sky blue?", "Recommend a good book",
)  # fmt: skip
# Share of rows whose answer is []; 1 in 8 (half of them chit-chat) left the tuned model calling
# tools that were not offered on 38 % of such held-out rows.
OFF_TOPIC_RATE = 0.2


def _join(first: str, template_first: str, second: str, template_second: str, rng: random.Random) -> str:
    # Lower-case the second clause only when it starts with plain wording, never a value; drop
    # the first clause's final punctuation only when it is the template's, never a value's ("happy birthday!").
    if not template_second.startswith("{") and not second.startswith("I "):
        second = second[0].lower() + second[1:]
    if not template_first.endswith("}"):
        first = first.rstrip("?.!")
    return rng.choice(JOINERS).format(a=first, b=second)


def _offer(needed: list[Tool], pool: tuple[Tool, ...], rng: random.Random, exclude: Tool | None = None) -> list[dict[str, Any]]:
    others = [t for t in pool if t not in needed and t is not exclude]
    # 3-5 tools in all; two-call rows carry two queries and answers, so they get 3.
    total = rng.randint(3, 5) if len(needed) < 2 else 3
    chosen = list(needed)
    # At most MAX_NEW_OFFERED held-out tools per row: their words are unknown to a tokenizer
    # trained on base text, and more of them would push rows past a 256-token budget.
    for tool in rng.sample(others, len(others)):
        if len(chosen) == total:
            break
        if tool.name in _NEW_NAMES and sum(t.name in _NEW_NAMES for t in chosen) >= MAX_NEW_OFFERED:
            continue
        chosen.append(tool)
    rng.shuffle(chosen)
    return [t.schema() for t in chosen]


def _make_row(pool: tuple[Tool, ...], offered: tuple[Tool, ...], rng: random.Random) -> dict[str, Any]:
    """One row whose calls use ``pool`` and whose distractors come from ``offered``."""
    roll = rng.random()
    if roll < OFF_TOPIC_RATE:  # off-topic: chit-chat, or a request for a tool that is not on offer
        if rng.random() < 1 / 3:
            return {"query": rng.choice(OFF_TOPIC), "tools": _offer([], offered, rng), "answers": []}
        missing = rng.choice(pool)
        query = fill(missing, rng)[0]
        return {"query": query, "tools": _offer([], offered, rng, exclude=missing), "answers": []}
    if roll < OFF_TOPIC_RATE + 0.2:  # two calls in one request
        # In the new part the second call may use any tool: new and familiar tools mix.
        a = rng.choice(pool)
        b = rng.choice([t for t in offered if t is not a])
        qa, args_a, ta = fill(a, rng)
        qb, args_b, tb = fill(b, rng)
        answers = [{"name": a.name, "arguments": args_a}, {"name": b.name, "arguments": args_b}]
        return {"query": _join(qa, ta, qb, tb, rng), "tools": _offer([a, b], offered, rng), "answers": answers}
    tool = rng.choice(pool)
    query, args, _ = fill(tool, rng)
    return {"query": query, "tools": _offer([tool], offered, rng), "answers": [{"name": tool.name, "arguments": args}]}


def generate_rows(n: int, part: Part = "base", seed: int = 0) -> list[dict[str, Any]]:
    """``n`` rows using only ``BASE_TOOLS`` or only ``NEW_TOOLS``; same arguments, same rows."""
    if part not in ("base", "new"):
        raise ValueError(f"part must be 'base' or 'new', got {part!r}")
    pool = BASE_TOOLS if part == "base" else NEW_TOOLS
    # Base rows never mention a held-out tool. New rows mix familiar distractors in, as a
    # real fine-tuning set would (and that keeps them short for the base tokenizer).
    offered = BASE_TOOLS if part == "base" else CATALOGUE
    # String seeds hash with sha512 inside random, so this is stable across runs and platforms.
    rng = random.Random(f"needle-sample:{part}:{seed}")
    return [_make_row(pool, offered, rng) for _ in range(n)]


def write_rows(path: str | Path, rows: list[dict[str, Any]]) -> Path:
    """Write rows as compact UTF-8 JSONL (one object per line, trailing newline)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r, ensure_ascii=False, separators=(",", ":")) + "\n" for r in rows)
    out.write_bytes(text.encode("utf-8"))
    return out


def write_sample(out_dir: str | Path, seed: int = 0, n_base: int = 12000, n_new: int = 4000,
                 n_conversations: int | None = None) -> dict[str, Path]:
    """Write ``base.jsonl`` and ``new.jsonl`` under ``out_dir``; returns their paths.

    ``new.jsonl`` ends with ``n_conversations`` conversations over the new tools
    (needle/data/sample_conversations.py; default 3 per 20 rows: 600 after the 4,000 rows).
    """
    d = Path(out_dir)
    n_conv = n_new * 3 // 20 if n_conversations is None else n_conversations
    return {
        "base": write_rows(d / "base.jsonl", generate_rows(n_base, "base", seed)),
        "new": write_rows(d / "new.jsonl", generate_rows(n_new, "new", seed) + generate_conversations(n_conv, seed)),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", help="directory for base.jsonl and new.jsonl")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--n-base", type=int, default=12000)
    parser.add_argument("--n-new", type=int, default=4000)
    parser.add_argument("--n-conversations", type=int, default=None, help="default: 3 per 20 new rows")
    args = parser.parse_args(argv)
    paths = write_sample(args.out_dir, args.seed, args.n_base, args.n_new, args.n_conversations)
    for part, path in paths.items():
        print(f"{part}: {path}")


if __name__ == "__main__":
    main()
