"""Deterministic synthetic conversations over the held-out tools: the agent loop in the sample.

Each conversation is an OpenAI ``messages`` row (needle/data/conversation.py) over
``needle.data.sample_tools.NEW_TOOLS``, in one of three shapes:

- ``answer``: the user asks, the assistant calls, the result comes back, the assistant answers
  in words from it ("Your taxi from the museum to the airport arrives in 7 minutes.");
- ``chain``: the user asks for two things, the assistant calls the first, reads its result,
  calls the second, reads that result, and answers both in words;
- ``error``: the result reports an error and the assistant tells the user and asks what to do.

Each tool's result and answer come from :data:`OUTCOMES`, with the call's own argument values,
so an answer can be checked against what was asked. A row offers its tool plus one distractor;
a chain offers its two tools, the second one of the one-parameter tools, and every row is at
most :data:`MAX_CHARS` long: that keeps it within the small preset's 320 tokens.

    from needle.data.sample_conversations import generate_conversations
    rows = generate_conversations(600, seed=0)
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from typing import Any

from needle.data.sample_tools import CATALOGUE, JOINERS, NEW_TOOLS, Tool, fill

Args = dict[str, Any]
Result = Callable[[Args, random.Random], dict[str, Any]]
Answer = Callable[[Args, dict[str, Any]], str]

_TOP = ("a review site", "the city's transport page", "an encyclopedia entry", "a shop listing", "a forum thread")


def _hhmm(rng: random.Random) -> str:
    return f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}"


# tool name -> (its result for these arguments, the answer in words from arguments and result)
OUTCOMES: dict[str, tuple[Result, Answer]] = {
    "book_taxi": (lambda a, r: {"status": "booked", "eta_min": r.randint(3, 15)},
                  lambda a, x: f"Your taxi from {a['origin']} to {a['destination']} arrives in {x['eta_min']} minutes."),
    "set_volume": (lambda a, r: {"volume": a["percent"]}, lambda a, x: f"The volume is now {x['volume']}%."),
    "lock_door": (lambda a, r: {"door": a["door"], "locked": a["locked"]},
                  lambda a, x: f"The {x['door']} door is {'locked' if x['locked'] else 'unlocked'}."),
    "order_food": (lambda a, r: {"status": "ordered", "eta_min": r.randint(15, 50)},
                   lambda a, x: f"I ordered {a['dish']} from {a['place']}; it arrives in {x['eta_min']} minutes."),
    "get_tip": (lambda a, r: {"tip": round(a["amount"] * a["percent"] / 100, 2)},
                lambda a, x: f"A {a['percent']}% tip on {a['amount']} is {x['tip']}."),
    "get_time": (lambda a, r: {"time": _hhmm(r)}, lambda a, x: f"It is {x['time']} in {a['city']}."),
    "search_web": (lambda a, r: {"top_result": r.choice(_TOP)},
                   lambda a, x: f"The top result for {a['text']} is {x['top_result']}."),
    "start_workout": (lambda a, r: {"status": "started"},
                      lambda a, x: f"Your {a['minutes']} minute {a['activity']} workout has started."),
    "set_fan": (lambda a, r: {"speed": a["speed"]}, lambda a, x: f"The {a['room']} fan is at speed {x['speed']}."),
    "book_table": (lambda a, r: {"status": "confirmed"},
                   lambda a, x: f"Your table for {a['people']} at {a['place']} at {a['time']} is booked."),
    "track_package": (lambda a, r: {"status": r.choice(["in transit", "out for delivery", "at the depot"])},
                      lambda a, x: f"Package {a['code']} is {x['status']}."),
}  # fmt: skip
ERRORS = ("the service is not responding", "the request was refused", "that is not available right now")
SHAPES = ("answer", "chain", "error")
# Compact-JSON length bound of a row: under the base's tokenizer (vocabulary 1024) the longest row
# then renders to about 300 tokens, within the small preset's 320 (a chain of two long calls
# reached 352).
MAX_CHARS = 1000


def _call(i: int, tool: Tool, args: Args) -> dict[str, Any]:
    return {"id": f"call_{i}", "type": "function", "function": {"name": tool.name, "arguments": json.dumps(args)}}


def _turn(i: int, tool: Tool, args: Args, result: dict[str, Any]) -> list[dict[str, Any]]:
    """An assistant turn calling ``tool`` and the tool message with its result."""
    return [{"role": "assistant", "content": None, "tool_calls": [_call(i, tool, args)]},
            {"role": "tool", "tool_call_id": f"call_{i}", "content": json.dumps(result)}]  # fmt: skip


def _offer(needed: list[Tool], rng: random.Random) -> list[dict[str, Any]]:
    distractor = rng.choice([t for t in CATALOGUE if t not in needed])
    chosen = [*needed, distractor]
    rng.shuffle(chosen)
    return [t.schema() for t in chosen]


def make_conversation(shape: str, rng: random.Random) -> dict[str, Any]:
    """One conversation row of ``shape`` (:data:`SHAPES`)."""
    tool = rng.choice(NEW_TOOLS)
    query, args, _ = fill(tool, rng)
    result_of, answer_of = OUTCOMES[tool.name]
    if shape == "error":
        error = rng.choice(ERRORS)
        messages = [{"role": "user", "content": query}, *_turn(1, tool, args, {"error": error}),
                    {"role": "assistant", "content": f"Sorry, {tool.description.lower()} failed: {error}. "
                                                     "Should I try again?"}]  # fmt: skip
        return {"messages": messages, "tools": _offer([tool], rng)}
    result = result_of(args, rng)
    if shape == "answer":
        messages = [{"role": "user", "content": query}, *_turn(1, tool, args, result),
                    {"role": "assistant", "content": answer_of(args, result)}]  # fmt: skip
        return {"messages": messages, "tools": _offer([tool], rng)}
    if shape != "chain":
        raise ValueError(f"shape must be one of {SHAPES}, got {shape!r}")
    second = rng.choice([t for t in NEW_TOOLS if t is not tool and len(t.params) == 1])
    query2, args2, _ = fill(second, rng)
    result2 = OUTCOMES[second.name][0](args2, rng)
    ask = rng.choice(JOINERS).format(a=query.rstrip("?.!"), b=query2[0].lower() + query2[1:])
    messages = [{"role": "user", "content": ask}, *_turn(1, tool, args, result), *_turn(2, second, args2, result2),
                {"role": "assistant", "content": f"{answer_of(args, result)} {OUTCOMES[second.name][1](args2, result2)}"}]  # fmt: skip
    return {"messages": messages, "tools": [t.schema() for t in (tool, second)]}


def generate_conversations(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` conversations, the three shapes in turn (answer, chain, error), each at most
    :data:`MAX_CHARS` of compact JSON (a longer draw is drawn again); same arguments, same rows."""
    rng = random.Random(f"needle-sample:conversations:{seed}")
    rows = []
    for i in range(n):
        row = make_conversation(SHAPES[i % len(SHAPES)], rng)
        while len(json.dumps(row, separators=(",", ":"))) > MAX_CHARS:
            row = make_conversation(SHAPES[i % len(SHAPES)], rng)
        rows.append(row)
    return rows
