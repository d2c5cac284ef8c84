"""Needle 3's own row format (cactus-needle 3.x) as a ``ChatFormat``, and its call parser.

What the reference's ``render_example`` / ``_encode`` (needle/model/finetune.py) build, byte for
byte and id for id::

    <bos>[<|im_start|>system\\n{system}<|im_end|>\\n]<|im_start|>user\\n<tools>{tools}</tools>\\n{query}<|im_end|>\\n<|im_start|>assistant\\n
    [<think>\\n{reasoning}\\n</think>\\n]<tool_call>{answers}</tool_call><|im_end|><eos>   <- target + eos: the loss tokens

``{tools}`` and ``{answers}`` are compact JSON (``separators=(",", ":")``, non-ASCII kept);
system and reasoning are stripped and their parts left out when empty (no default system
prompt: Needle has none). BOS (id 2) and EOS (id 1) are control pieces that no text encodes to,
so they are added as ids: BOS before the prompt, EOS after the target, with loss on the target
and EOS. Unlike the reference, which cuts rows at ``max_len`` without a word, an over-long row is
flagged (``Example.truncated``) and the data preparation refuses or drops it, as for every other
format (needle/data/prepare.py).

    fmt = Needle3Format()                                  # or format_for(Needle3Tokenizer)
    ex = fmt.encode_example(row, tok, max_len=2048)        # ids, loss_mask, truncated
    prompt_ids = fmt.encode_prompt(row, tok)               # [bos] + prompt: what generation starts from
    fmt.parse('<tool_call>[{"name":"f","arguments":{}}]</tool_call><|im_end|>').calls
    parser_for("needle3") is parse_needle3                 # needle/data/parse.py

``render_example(example)`` is the reference's function on a raw example dict (tools or answers
as a JSON string are kept verbatim there); needle's rows (``Row``) hold parsed tools, which are
re-serialised compactly, so a row whose tools came as a JSON string with spaces renders its tools
compactly here.

Ported from cactus-needle 3.2.8 (needle/model/finetune.py), Apache-2.0.
"""

from __future__ import annotations

from typing import Any

from needle.data.conversation import row_messages
from needle.data.parse import ParsedCall, parse_needle3
from needle.data.render import Example, compact_json, format_calls, join_example
from needle.data.schema import Row
from needle.tokenizers.base import TokenizerLike
from needle.tokenizers.markers import (
    BOS_ID, EOS_ID, IM_END, IM_START, THINK_END, THINK_START, TOOLS_END, TOOLS_START, TOOL_CALL_END, TOOL_CALL_START, TOOL_RESULT_END, TOOL_RESULT_START,
)  # fmt: skip

FORMAT_ID = "needle3"
TEMPLATE_VERSION = "1"
# What template_id() hashes into the data fingerprint; rendering is the code below (the reference's).
TEMPLATE = (
    "<bos>[<|im_start|>system\\n{system}<|im_end|>\\n]<|im_start|>user\\n<tools>{tools}</tools>\\n{query}"
    "<|im_end|>\\n<|im_start|>assistant\\n||[<think>\\n{reasoning}\\n</think>\\n]<tool_call>{answers}"
    "</tool_call><|im_end|><eos>"
)


def _json_text(value: Any) -> str:
    return value if isinstance(value, str) else compact_json(value)


def render_example(example: dict[str, Any]) -> tuple[str, str]:
    """(prompt, target) of a raw example dict, exactly as the reference's ``render_example``."""
    tools_json = _json_text(example.get("tools", []))
    answers_json = _json_text(example.get("answers", example.get("function_calls", [])))
    reasoning = (example.get("reasoning") or "").strip()
    system = (example.get("system") or "").strip()
    prefix = f"{IM_START}system\n{system}{IM_END}\n" if system else ""
    prompt = (f"{prefix}{IM_START}user\n{TOOLS_START}{tools_json}{TOOLS_END}\n"
              f"{example['query']}{IM_END}\n{IM_START}assistant\n")  # fmt: skip
    think = f"{THINK_START}\n{reasoning}\n{THINK_END}\n" if reasoning else ""
    return prompt, f"{think}{TOOL_CALL_START}{answers_json}{TOOL_CALL_END}{IM_END}"


def _example(row: Row) -> dict[str, Any]:
    return {"query": row.query, "tools": row.tools, "answers": format_calls(row.answers),
            "reasoning": row.reasoning, "system": row.system}  # fmt: skip


def _special_id(tok: TokenizerLike, attr: str, want: int) -> int:
    got = getattr(tok, attr, None)
    if got != want:
        raise ValueError(f"{tok!r} is not a Needle 3 tokenizer ({attr} is {got}, Needle's is {want}): "
                         "the needle3 format needs needle.tokenizers.needle3.Needle3Tokenizer")  # fmt: skip
    return want


def conversation_segments(row: Row) -> list[tuple[str, int | None]]:
    """A conversation in Needle 3's turns as (text, assistant message index or None) segments.

    The reference renders one query and its calls; a conversation continues in the same ChatML
    turns, the tools in the first user turn as there, each tool result in Needle's own markers::

        [<|im_start|>system\\n{system}<|im_end|>\\n]<|im_start|>user\\n<tools>{tools}</tools>\\n{query}<|im_end|>\\n
        <|im_start|>assistant\\n + [<think>\\n{reasoning}\\n</think>\\n]{text}[<tool_call>{calls}</tool_call>]<|im_end|>  <- loss
        \\n<|im_start|>tool\\n<tool_result>{"name": tool, "content": result}</tool_result><|im_end|>\\n
        <|im_start|>user\\n{text}<|im_end|>\\n

    so a query/answers row gives exactly :func:`render_example`'s prompt and target.
    """
    messages = row_messages(row)
    out: list[tuple[str, int | None]] = []
    text = ""
    first_user = True
    for i, m in enumerate(messages):
        if m["role"] == "system":
            system = m["content"].strip()
            text += f"{IM_START}system\n{system}{IM_END}\n" if system else ""
        elif m["role"] == "user":
            tools = f"{TOOLS_START}{compact_json(row.tools)}{TOOLS_END}\n" if first_user else ""
            text += f"{IM_START}user\n{tools}{m['content']}{IM_END}\n"
            first_user = False
        elif m["role"] == "tool":
            result = compact_json({"name": m["name"], "content": m["content"]})
            text += f"{IM_START}tool\n{TOOL_RESULT_START}{result}{TOOL_RESULT_END}{IM_END}\n"
        else:
            reasoning = (m.get("reasoning_content") or "").strip()
            body = f"{THINK_START}\n{reasoning}\n{THINK_END}\n" if reasoning else ""
            body += m.get("content") or ""
            if m.get("tool_calls") is not None:
                body += f"{TOOL_CALL_START}{format_calls([c['function'] for c in m['tool_calls']])}{TOOL_CALL_END}"
            out += [(text + f"{IM_START}assistant\n", None), (body + IM_END, i)]
            text = "\n"  # the newline after <|im_end|> opens the next turn (no loss on it)
    return out


class Needle3Format:
    """Needle 3's row format as a :class:`~needle.data.render.ChatFormat`."""

    name = FORMAT_ID

    def render_prompt(self, row: Row) -> str:
        """Everything up to and including ``<|im_start|>assistant\\n`` (BOS is an id, not text)."""
        return render_example(_example(row))[0]

    def render_target(self, row: Row) -> str:
        """``[<think>…</think>\\n]<tool_call>[…]</tool_call><|im_end|>`` (EOS is an id, not text)."""
        return render_example(_example(row))[1]

    def encode_prompt(self, row: Row, tok: TokenizerLike) -> list[int]:
        """``[bos] + encode(prompt)``: the ids generation continues from (the reference's ``generate``)."""
        return [_special_id(tok, "bos_id", BOS_ID), *tok.encode(self.render_prompt(row))]

    def encode_example(self, row: Row, tok: TokenizerLike, max_len: int) -> Example:
        """``[bos] + prompt + target + [eos]``, loss on target and eos; over ``max_len`` flagged."""
        prompt, target = render_example(_example(row))
        bos, eos = _special_id(tok, "bos_id", BOS_ID), _special_id(tok, "eos_id", EOS_ID)
        return join_example([bos, *tok.encode(prompt)], [*tok.encode(target), eos], max_len)

    def encode_conversation(self, row: Row, tok: TokenizerLike, max_len: int, loss_on: str = "all_assistant") -> Example:
        """``[bos]`` + the segments, each encoded on its own, + ``[eos]`` (loss on it with the last
        turn); loss on the assistant turns (``all_assistant``) or the last (``last_assistant``)."""
        bos, eos = _special_id(tok, "bos_id", BOS_ID), _special_id(tok, "eos_id", EOS_ID)
        segments = conversation_segments(row)
        last = segments[-1][1]
        ids, mask = [bos], [0]
        for text, turn in segments:
            part = tok.encode(text) + ([eos] if turn == last else [])
            ids += part
            mask += [int(turn is not None and (loss_on == "all_assistant" or turn == last))] * len(part)
        return Example(ids[:max_len], mask[:max_len], len(ids) > max_len)

    def template_id(self) -> str:
        return f"{FORMAT_ID}:{TEMPLATE_VERSION}:{TEMPLATE}"

    def parse(self, text: str) -> ParsedCall:
        return parse_needle3(text)

    def __repr__(self) -> str:
        return "Needle3Format()"
