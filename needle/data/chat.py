"""A pretrained model's own Jinja chat template as a ``ChatFormat``, and ``format_for(tokenizer)``.

``JinjaChatFormat`` renders a row exactly as transformers' ``apply_chat_template(messages,
tools=…, tokenize=False)`` does (same sandboxed Jinja environment, filters and globals, copied
from transformers/utils/chat_template_utils.py; transformers is never imported). A row becomes

    [{"role": "system", …} if row.system] + {"role": "user", "content": query}
    + {"role": "assistant", "content": "", "tool_calls": [{"type": "function",
       "function": {"name", "arguments": {…}}}, …]}          (no tool_calls key when answers == [])

with the tools in OpenAI function format (``{"type": "function", "function": tool}``). The
prompt is the conversation without the assistant turn, rendered with
``add_generation_prompt=True``; the target is the rest of the full rendering (an error when the
prompt is not a prefix of it), and only the target's tokens carry loss.

Templates that do not render tools or tool calls (Gemma 3's, for one) still get them: the tools
go into the system message as JSON lines with an instruction, and the calls become the
assistant's content as a compact JSON list (``[]`` off-topic), parsed by ``parse_json_list``.

    fmt = format_for(tokenizer)          # JinjaChatFormat, or NativeFormat (with a warning)
    ex = fmt.encode_example(row, tokenizer, max_len=1024)
    fmt.parse(generated_text).calls
"""

from __future__ import annotations

import json
import logging
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

from needle.data.conversation import row_messages
from needle.data.needle3_format import Needle3Format
from needle.data.parse import ParsedCall, Parser, parse_json_list, parser_for
from needle.data.render import (
    ChatFormat, DEFAULT_SYSTEM, Example, NativeFormat, compact_json, format_calls, join_example,
)  # fmt: skip
from needle.data.schema import Row
from needle.tokenizers.base import TokenizerLike
from needle.tokenizers.native import Tokenizer
from needle.tokenizers.needle3 import Needle3Tokenizer

log = logging.getLogger(__name__)
TOOLS_INSTRUCTION = (
    "You can call these tools, given as JSON schemas, one per line:\n{tools}\n\n"
    'Answer with a JSON list of tool calls, [{{"name": tool name, "arguments": {{…}}}}], '
    "and with [] when no tool fits the request."
)


class ChatTemplateError(ValueError):
    """A chat template refused a row (raise_exception) or broke the prompt/target split."""


class _GenerationTag(jinja2.ext.Extension):
    # transformers' AssistantTracker: `{% generation %}…{% endgeneration %}` renders its body.
    # Needle finds the assistant turn by the prompt prefix instead, so no tracking is needed.
    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:  # fmt: skip
    # transformers' override: no HTML escaping, and indent/separators exposed.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    # transformers' limited `dict` global: construction only, no attribute access into dict.
    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    # transformers' namespace: refuses underscore names (a sandbox escape route).
    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805  (Jinja's own signature trick)
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore attributes ({name!r})")


@lru_cache(maxsize=16)
def compile_template(template: str) -> jinja2.Template:
    """The template compiled in transformers' environment (cached: one compile per text)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env.from_string(template)


def template_variables(template: str) -> frozenset[str]:
    """The variables a template reads (``tools``, ``messages``, …)."""
    env = ImmutableSandboxedEnvironment(extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    return frozenset(jinja2.meta.find_undeclared_variables(env.parse(template)))


def _jinja_str(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n") + "'"


def with_tool_listing(template: str) -> str:
    """``template`` made to show OpenAI ``tools`` as needle trains a model whose template cannot:
    in the system message (the caller's, else needle's default), as the JSON lines and instruction
    of ``TOOLS_INSTRUCTION``. A template that renders ``tools`` comes back unchanged.

    For files other programs prompt (a GGUF export: llama.cpp's and Ollama's OpenAI routes pass
    the request's ``tools`` to the template): without it the tuned model never sees the tools.
    Rendered by :class:`JinjaChatFormat` the result gives the original's prompts and targets.
    """
    if "tools" in template_variables(template):
        return template
    head, tail = TOOLS_INSTRUCTION.format(tools="\0").split("\0")
    return (
        "{% if tools is defined and tools is not none %}"
        "{% set needle_ns = namespace(listing='') %}"
        "{% for tool in tools %}"
        "{% set fn = tool['function'] if tool['function'] is defined else tool %}"
        "{% set needle_ns.listing = needle_ns.listing + ('' if loop.first else '\\n') + (fn | tojson) %}"
        "{% endfor %}"
        f"{{% set needle_tools = {_jinja_str(head)} + needle_ns.listing + {_jinja_str(tail)} %}}"
        "{% if messages and messages[0]['role'] == 'system' %}"
        f"{{% set messages = [{{'role': 'system', 'content': (messages[0]['content'] or {_jinja_str(DEFAULT_SYSTEM)})"
        " + '\\n\\n' + needle_tools}] + messages[1:] %}"
        "{% else %}"
        f"{{% set messages = [{{'role': 'system', 'content': {_jinja_str(DEFAULT_SYSTEM)} + '\\n\\n' + needle_tools}}]"
        " + messages %}"
        "{% endif %}"
        "{% endif %}"
    ) + template


def _alias_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    # As transformers does: reasoning also under `thinking` (gpt-oss templates read that).
    reasoning = message.get("reasoning_content")
    return {"thinking": reasoning, **message, "reasoning_content": reasoning} if reasoning is not None else message


class JinjaChatFormat:
    """A model's Jinja chat template as a :class:`~needle.data.render.ChatFormat`."""

    def __init__(self, template: str, special_tokens: dict[str, str] | None = None,
                 template_kwargs: dict[str, Any] | None = None) -> None:  # fmt: skip
        self.template = template
        self.special_tokens = dict(special_tokens or {})
        # Extra template variables (e.g. Llama's date_string, Qwen's enable_thinking). Without
        # date_string, Llama 3.x templates write today's date, so prepared data depends on the day.
        self.template_kwargs = dict(template_kwargs or {})
        self._compiled = compile_template(template)
        self.renders_tools = "tools" in template_variables(template)
        self.renders_calls = "tool_calls" in template
        self._parser: Parser = parser_for(template) if self.renders_calls else parse_json_list

    # -- rows to messages --------------------------------------------------------------------
    def tools(self, row: Row) -> list[dict[str, Any]] | None:
        """The row's tools in OpenAI function format (None when the template cannot show them)."""
        return [{"type": "function", "function": t} for t in row.tools] if self.renders_tools else None

    def messages(self, row: Row) -> list[dict[str, Any]]:
        """System (when set or needed), user and assistant messages of ``row``."""
        system = row.system
        if not self.renders_tools:
            listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in row.tools)
            system = f"{system or DEFAULT_SYSTEM}\n\n{TOOLS_INSTRUCTION.format(tools=listing)}"
        out = [{"role": "system", "content": system}] if system else []
        out.append({"role": "user", "content": row.query})
        answer: dict[str, Any] = {"role": "assistant", "content": ""}
        if not self.renders_calls:
            answer["content"] = format_calls(row.answers)
        elif row.answers:
            answer["tool_calls"] = [
                {"type": "function", "function": {"name": a["name"], "arguments": a["arguments"]}} for a in row.answers
            ]
        if row.reasoning:
            answer["reasoning_content"] = row.reasoning
        return [*out, answer]

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
               add_generation_prompt: bool = False) -> str:  # fmt: skip
        """The template's text for ``messages``, as ``apply_chat_template(tokenize=False)``."""
        try:
            return self._compiled.render(
                messages=[_alias_reasoning(m) for m in messages], tools=tools, documents=None,
                add_generation_prompt=add_generation_prompt, **self.special_tokens, **self.template_kwargs,
            )  # fmt: skip
        except jinja2.exceptions.TemplateError as exc:
            raise ChatTemplateError(f"chat template refused the conversation: {exc}") from None

    # -- ChatFormat ---------------------------------------------------------------------------
    def render_prompt(self, row: Row) -> str:
        return self.render(self.messages(row)[:-1], self.tools(row), add_generation_prompt=True)

    def render_target(self, row: Row) -> str:
        return self.split(row)[1]

    def split(self, row: Row) -> tuple[str, str]:
        """(prompt, target): the full rendering cut where the generation prompt ends."""
        try:
            prompt = self.render_prompt(row)
            full = self.render(self.messages(row), self.tools(row))
        except ChatTemplateError as exc:
            raise ChatTemplateError(f"{row.source}: {exc}") from None
        if not full.startswith(prompt):
            raise ChatTemplateError(f"{row.source}: the rendered prompt is not a prefix of the full conversation")
        return prompt, full[len(prompt) :]

    def encode_example(self, row: Row, tok: TokenizerLike, max_len: int) -> Example:
        """Prompt and target encoded separately, as the model will see the prompt at inference."""
        prompt, target = self.split(row)
        return join_example(tok.encode(prompt), tok.encode(target), max_len)

    # -- whole conversations (issue 21) ----------------------------------------------------------
    def conversation(self, row: Row) -> list[dict[str, Any]]:
        """The template's messages for the row's whole conversation (``row_messages``); for a
        query/answers row exactly :meth:`messages`. Templates that cannot show calls get them as
        the JSON list in the assistant's content, and tool results as a user message."""
        out: list[dict[str, Any]] = []
        for m in row_messages(row):
            if m["role"] == "system" or (not out and not self.renders_tools):
                if not self.renders_tools:  # the tool listing joins (or makes) the system message
                    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in row.tools)
                    base = m["content"] if m["role"] == "system" else DEFAULT_SYSTEM
                    out.append({"role": "system", "content": f"{base}\n\n{TOOLS_INSTRUCTION.format(tools=listing)}"})
                    if m["role"] == "system":
                        continue
                else:
                    out.append(dict(m))
                    continue
            if m["role"] == "user":
                out.append(dict(m))
            elif m["role"] == "assistant":
                out.append(self._assistant(m))
            elif self.renders_calls:
                out.append(dict(m))
            elif out[-1]["role"] == "user" and out[-1].get("_results"):
                out[-1]["content"] += "\n" + compact_json({"name": m["name"], "content": m["content"]})
            else:
                out.append({"role": "user", "_results": True,
                            "content": "Tool results:\n" + compact_json({"name": m["name"], "content": m["content"]})})
        return [{k: v for k, v in m.items() if k != "_results"} for m in out]

    def _assistant(self, m: dict[str, Any]) -> dict[str, Any]:
        calls = m.get("tool_calls")
        answer: dict[str, Any] = {"role": "assistant", "content": m.get("content") or ""}
        if not self.renders_calls:
            if calls is not None:  # calls (or [] off-topic) as the JSON list, after any text
                text = format_calls([{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in calls])
                answer["content"] = f"{answer['content']}\n{text}" if answer["content"] else text
        elif calls:
            answer["tool_calls"] = [dict(c) for c in calls]
        if m.get("reasoning_content"):
            answer["reasoning_content"] = m["reasoning_content"]
        return answer

    def _end_of_turn(self) -> str:
        """What the template writes after an assistant's text: where a turn's loss ends."""
        probe = "needle-turn-probe"
        msgs = [{"role": "user", "content": "x"}, {"role": "assistant", "content": probe}]
        full = self.render(msgs, None)
        return full[len(self.render(msgs[:1], None, add_generation_prompt=True)) :].split(probe)[-1]

    def conversation_segments(self, row: Row) -> list[tuple[str, int | None]]:
        """The rendering cut into (text, assistant turn or None): each assistant turn from where
        the generation prompt before it ends through its end-of-turn text, the last one to the end
        (so a query/answers row gives today's prompt and target). Their concatenation is
        ``apply_chat_template(conversation, tools=…)``."""
        msgs, tools = self.conversation(row), self.tools(row)
        try:
            full = self.render(msgs, tools)
            turns = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
            starts = [len(self.render(msgs[:i], tools, add_generation_prompt=True)) for i in turns]
        except ChatTemplateError as exc:
            raise ChatTemplateError(f"{row.source}: {exc}") from None
        end_text = self._end_of_turn() if len(turns) > 1 else ""
        out: list[tuple[str, int | None]] = []
        pos = 0
        for n, (i, start) in enumerate(zip(turns, starts)):
            prompt = self.render(msgs[:i], tools, add_generation_prompt=True)
            if not full.startswith(prompt) or start < pos:
                raise ChatTemplateError(f"{row.source}: messages[{i}]: the rendering before this assistant turn is "
                                        "not a prefix of the whole conversation")  # fmt: skip
            if n == len(turns) - 1:
                end = len(full)
            else:
                found = full.find(end_text, start) if end_text else -1
                end = found + len(end_text)
                if found < 0 or end > starts[n + 1]:
                    raise ChatTemplateError(f"{row.source}: messages[{i}]: cannot find where this assistant turn ends")
            out += [(full[pos:start], None), (full[start:end], i)]
            pos = end
        if pos < len(full):
            out.append((full[pos:], None))
        return [seg for seg in out if seg[0] or seg[1] is not None]

    def encode_conversation(self, row: Row, tok: TokenizerLike, max_len: int,
                            loss_on: str = "all_assistant") -> Example:  # fmt: skip
        """Each segment encoded on its own (as prompt and target are today), loss on the assistant
        turns (``all_assistant``) or on the last one only (``last_assistant``); over ``max_len`` flagged."""
        segments = self.conversation_segments(row)
        last = max(t for _, t in segments if t is not None)
        ids: list[int] = []
        mask: list[int] = []
        for text, turn in segments:
            part = tok.encode(text)
            loss = turn is not None and (loss_on == "all_assistant" or turn == last)
            ids += part
            mask += [int(loss)] * len(part)
        return Example(ids[:max_len], mask[:max_len], len(ids) > max_len)

    def template_id(self) -> str:
        parts = {"kind": "jinja", "template": self.template, "special_tokens": self.special_tokens,
                 "template_kwargs": self.template_kwargs}  # fmt: skip
        return json.dumps(parts, sort_keys=True, ensure_ascii=False)

    def parse(self, text: str) -> ParsedCall:
        return self._parser(text)

    def __repr__(self) -> str:
        return f"JinjaChatFormat(parser={self._parser.__name__}, renders_tools={self.renders_tools})"


def format_for(tok: TokenizerLike, template_kwargs: dict[str, Any] | None = None) -> ChatFormat:
    """The chat format of a tokenizer: Needle 3's for its tokenizer, its own Jinja template,
    else needle's (with a warning)."""
    if isinstance(tok, Needle3Tokenizer):
        return Needle3Format()
    template = getattr(tok, "chat_template", None)
    if template:
        return JinjaChatFormat(template, getattr(tok, "special_tokens_map", {}), template_kwargs)
    if not isinstance(tok, Tokenizer):
        log.warning("%r has no chat template: using needle's own template (needle/data/render.py)", tok)
    return NativeFormat()
