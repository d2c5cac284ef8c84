"""Needle's chat template and the ``ChatFormat`` interface every template implements.

Needle's own template (one definition, ``TEMPLATE``, from which rendering is derived and which
the data fingerprint hashes):

    <|bos|><|system|>{system}<|end|><|tools|>{tools JSON}<|end|><|user|>{query}<|end|><|assistant|>
    [<|think|>{reasoning}]<|call|>{answers JSON}<|end|>          <- target: the only loss tokens

JSON is compact (``separators=(",", ":")``, ``ensure_ascii=False``) with keys in the given
order. Bump ``TEMPLATE_VERSION`` on any change: it is part of the data fingerprint.
A pretrained model's own Jinja template is ``needle.data.chat.JinjaChatFormat``;
``needle.data.chat.format_for(tokenizer)`` picks the format for a tokenizer. Needle 3's own row
format (cactus-needle's) is ``needle.data.needle3_format.Needle3Format``; ``encode_prompts``
gives any format's prompt ids (that one adds BOS as an id).

    ex = encode_example(row, tokenizer, max_len=256)          # needle's template
    fmt = NativeFormat(); fmt.parse(generated_text).calls
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import re
from typing import Protocol, runtime_checkable

from needle.data.conversation import row_messages
from needle.data.parse import ParsedCall, parse_calls
from needle.data.schema import Row
from needle.tokenizers.base import ASSISTANT, BOS, CALL, END, SYSTEM, THINK, TOOLS, USER, TokenizerLike

TEMPLATE_VERSION = "1"
DEFAULT_SYSTEM = "Answer by calling the right tools."
# The template itself: rendering is derived from it (below) and the fingerprint hashes it, so
# an edit here changes both at once. "||" separates prompt and target; "[...]" is optional.
TEMPLATE = (
    f"{BOS}{SYSTEM}{{system}}{END}{TOOLS}{{tools}}{END}{USER}{{query}}{END}{ASSISTANT}"
    f"||[{THINK}{{reasoning}}]{CALL}{{answers}}{END}"
)
PROMPT_TEMPLATE, TARGET_TEMPLATE = TEMPLATE.split("||")
_OPTIONAL = re.compile(r"\[([^\]]*)\]")


def _fill(template: str, **values: str | None) -> str:
    """Format ``template``; an optional ``[...]`` part is kept only when its fields are all set."""

    def optional(match: re.Match[str]) -> str:
        part = match.group(1)
        fields = re.findall(r"\{(\w+)\}", part)
        return part if all(values.get(f) for f in fields) else ""

    return _OPTIONAL.sub(optional, template).format(**values)


def compact_json(value: Any) -> str:
    """The template's JSON: no spaces, non-ASCII kept, key order as given."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def format_calls(answers: list[dict[str, Any]]) -> str:
    """The call list exactly as the model must emit it after ``<|call|>``."""
    return compact_json([{"name": a["name"], "arguments": a["arguments"]} for a in answers])


def render_prompt(row: Row) -> str:
    """Everything up to and including ``<|assistant|>``: what the model is given."""
    system = row.system if row.system else DEFAULT_SYSTEM
    return _fill(PROMPT_TEMPLATE, system=system, tools=compact_json(row.tools), query=row.query)


def render_target(row: Row) -> str:
    """The assistant turn the model learns to produce, ending with ``<|end|>``."""
    return _fill(TARGET_TEMPLATE, reasoning=row.reasoning, answers=format_calls(row.answers))


def render_text(row: Row) -> str:
    """Prompt and target together (what the tokenizer is trained on)."""
    return render_prompt(row) + render_target(row)


@dataclass(frozen=True)
class Example:
    """Token ids of prompt+target, 1 in ``loss_mask`` on target tokens only."""

    ids: list[int]
    loss_mask: list[int]
    truncated: bool


def join_example(prompt: list[int], target: list[int], max_len: int) -> Example:
    """Prompt then target ids, loss on the target; over ``max_len`` keeps the first tokens."""
    ids = prompt + target
    mask = [0] * len(prompt) + [1] * len(target)
    truncated = len(ids) > max_len
    return Example(ids[:max_len], mask[:max_len], truncated)


def encode_example(row: Row, tok: TokenizerLike, max_len: int) -> Example:
    """Tokenize one row; rows over ``max_len`` keep their first ``max_len`` tokens.

    Prompt and target are encoded separately so the loss boundary is exact (no BPE merge can
    straddle it: both sides of it are special tokens anyway). With a tokenizer that lacks
    needle's ``<|end|>`` token (a Hugging Face model without a chat template), the tokenizer's
    own end id closes the target, so generation still stops there.
    """
    prompt = tok.encode(render_prompt(row))
    target = tok.encode(render_target(row))
    if target[-1:] != [tok.end_id]:
        target.append(tok.end_id)
    return join_example(prompt, target, max_len)


def encode_prompts(fmt: "ChatFormat", rows: list[Row], tok: TokenizerLike) -> list[list[int]]:
    """The prompt ids generation starts from: ``fmt.encode_prompt`` where a format has one
    (Needle 3's adds BOS, an id no text encodes to), else the encoded ``render_prompt`` text."""
    own = getattr(fmt, "encode_prompt", None)
    if own is not None:
        return [own(row, tok) for row in rows]
    return tok.encode_batch([fmt.render_prompt(row) for row in rows])


@runtime_checkable
class ChatFormat(Protocol):
    """How rows become model text and ids, and how the model's answer is read back."""

    def render_prompt(self, row: Row) -> str:
        """Everything the model is given, up to where its answer starts."""
        ...

    def render_target(self, row: Row) -> str:
        """The answer the model learns to produce (the loss tokens), end-of-turn included."""
        ...

    def encode_example(self, row: Row, tok: TokenizerLike, max_len: int) -> Example:
        """Token ids of prompt + target with the loss mask on the target only."""
        ...

    def template_id(self) -> str:
        """Text that identifies the rendering; hashed into the data fingerprint."""
        ...

    def parse(self, text: str) -> "ParsedCall":
        """The tool calls in a decoded answer (never raises)."""
        ...


def conversation_segments(row: Row) -> list[tuple[str, int | None]]:
    """A conversation in needle's template as (text, assistant message index or None) segments::

        <|bos|><|system|>{system}<|end|><|tools|>{tools}<|end|>      then per message:
        user       <|user|>{content}<|end|>
        assistant  <|assistant|> + [<|think|>{reasoning}]{content}[<|call|>{calls}]<|end|>   <- loss
        tool       <|tools|>{"name": tool, "content": result}<|end|>

    ``<|call|>`` is written when the turn has a call list (``[]`` included, the off-topic answer),
    so a query/answers row gives exactly :func:`render_prompt` and :func:`render_target`. A turn
    with reasoning and a text answer but no calls is refused (``ValueError``): no token would
    separate the two.
    """
    messages = row_messages(row)
    system = messages[0]["content"] if messages[0]["role"] == "system" else DEFAULT_SYSTEM
    out: list[tuple[str, int | None]] = []
    text = f"{BOS}{SYSTEM}{system}{END}{TOOLS}{compact_json(row.tools)}{END}"
    for i, m in enumerate(messages):
        if m["role"] == "user":
            text += f"{USER}{m['content']}{END}"
        elif m["role"] == "tool":
            text += f"{TOOLS}{compact_json({'name': m['name'], 'content': m['content']})}{END}"
        elif m["role"] == "assistant":
            calls, reasoning, content = m.get("tool_calls"), m.get("reasoning_content"), m.get("content") or ""
            if reasoning and content and calls is None:
                raise ValueError(f"messages[{i}]: needle's native format cannot separate reasoning from a text answer")
            body = f"{THINK}{reasoning}" if reasoning else ""
            body += content
            if calls is not None:
                body += CALL + format_calls([c["function"] for c in calls])
            out += [(text + ASSISTANT, None), (body + END, i)]
            text = ""
    return out


class NativeFormat:
    """Needle's own template (the module-level functions, as a :class:`ChatFormat`)."""

    name = "needle"

    def encode_conversation(self, row: Row, tok: TokenizerLike, max_len: int, loss_on: str = "all_assistant") -> Example:
        """A whole conversation (:func:`conversation_segments`), each segment encoded on its own,
        loss on the assistant turns (``all_assistant``) or the last (``last_assistant``); a
        tokenizer without ``<|end|>`` closes each turn with its own end id, as for rows."""
        segments = conversation_segments(row)
        last = segments[-1][1]
        ids: list[int] = []
        mask: list[int] = []
        for text, turn in segments:
            part = tok.encode(text)
            if turn is not None and part[-1:] != [tok.end_id]:
                part.append(tok.end_id)
            ids += part
            mask += [int(turn is not None and (loss_on == "all_assistant" or turn == last))] * len(part)
        return Example(ids[:max_len], mask[:max_len], len(ids) > max_len)

    def render_prompt(self, row: Row) -> str:
        return render_prompt(row)

    def render_target(self, row: Row) -> str:
        return render_target(row)

    def encode_example(self, row: Row, tok: TokenizerLike, max_len: int) -> Example:
        return encode_example(row, tok, max_len)

    def template_id(self) -> str:
        # Exactly what compute_fingerprint has always hashed, so existing caches stay valid.
        return f"needle:{TEMPLATE_VERSION}:{TEMPLATE}"

    def parse(self, text: str) -> "ParsedCall":
        return parse_calls(text)

    def __repr__(self) -> str:
        return "NativeFormat()"
