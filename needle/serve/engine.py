"""One loaded model answering tool-call requests, each with its own tools: what predict and serving share.

``Predictor(loaded)`` keeps the model, its chat format and (lazily) its call grammars
(needle/eval/constrain.py, compiled once per tool set and mode). ``predict(requests)`` takes
``(query, tools)`` pairs or :class:`Request` objects and returns, per request, the parsed call
list, a text answer ``{"content": text, "finished": bool}``, or an error object
``{"error": reason, "raw": generated text}``; a request that cannot be served (bad tools, empty
query, a bad conversation, a prompt too long for the context, a schema the grammar cannot take)
gets its error without stopping the others. ``predict_detailed`` returns the same predictions as
``Answer`` objects (needle/serve/prompt.py) with the token counts a chat reply's ``usage``
reports (the prompt as the model saw it, the tokens decoded, the stop id included) and whether
the budget ran out before the end marker (``cut``: a turn unreadable for that is a ``"length"``
reply in chat, not an error). Tools are read in the dialects clients send
(needle/serve/dialects.py: ``"dict"``, ``"float"``, ``"any"``…).

The answer's token budget is ``cfg.max_new_tokens`` (96 by default). Without an explicit budget
from the caller (no ``cfg``, or one that leaves ``max_new_tokens`` at its default), a prompt that
leaves less than that of the context is still answered, in what is left of it (as OpenAI-style
servers do; a text answer cut there is ``finished: False``): only a prompt that does not fit the
context itself is refused. A ``cfg`` that sets ``max_new_tokens`` asks for that budget whole, and
a prompt that leaves less is refused. A request's own ``max_tokens`` (OpenAI's ``max_tokens``)
replaces the budget and is capped by the context the same way: the answer takes at most what
the prompt leaves. A text answer is cut at the first of the request's ``stop`` strings (the
decode itself runs to the end marker or the budget; the counts stop at the token that completed
the string).

A request is a query (the table shape's single turn) or the conversation so far (OpenAI
messages, tool results included), whose prompt is rendered as training renders conversations
(needle/serve/prompt.py). Its ``mode`` is the grammar's (needle/eval/constrain.py ``MODES``):
``calls`` (a call list, ``[]`` included: a query's answer, as ever), ``auto`` (calls or text),
``required`` (at least one call), ``none`` (text); ``only`` names the one tool the grammar
offers (OpenAI's named ``tool_choice``) while the prompt still lists them all. Outside ``calls``
a turn is read back by needle/eval/reply.py; without the grammar (``constrained=False``) the
mode and ``only`` are not enforced.

Prompts share prefixes (an app's system turn and tool block, a conversation's earlier turns):
their keys and values are kept in a ``PrefixCache`` (needle/serve/prefix_cache.py) of
``prefix_cache_mb`` megabytes, by default ``NEEDLE_PREFIX_CACHE_MB`` or 256 (0 turns it off), and
only the rest of each prompt is prefilled.

Concurrent callers (the scoring server runs each request in a thread) are batched: while one
decode runs, newly arrived rows queue; the next caller to find the decoder idle decodes every
queued row with the same budget (up to ``batch_size``, constrained and free rows together:
matchers are per row) and hands each caller its own results. Four concurrent one-query clients
thus share one decode instead of waiting for four. A caller's ``on_token`` hears its rows' tokens
as they are decoded, from the decoding thread (a streamed reply, needle/serve/stream.py); a batch
with such a row decodes on the host loop (needle/eval/decode.py).

    p = Predictor(load_model("runs/tuned/model"))
    p.predict([("turn on the lights", tools)], constrained=True)
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from needle.config import EvalConfig
from needle.data.chat import format_for
from needle.data.render import encode_prompts
from needle.data.schema import Row, parse_row
from needle.data.turns import conversation_prompt
from needle.eval.constrain import Constraints, ToolSchemaError, UnsupportedFormat
from needle.eval.decode import generate_detailed, prompt_budget
from needle.eval.reply import read_reply
from needle.model.factory import LoadedModel, module_for
from needle.serve.dialects import normalise_tools
from needle.serve.prefix_cache import PrefixCache
from needle.serve.prompt import Answer, Request, conversation_row

Prediction = list[dict[str, Any]] | dict[str, Any]
PREFIX_CACHE_ENV = "NEEDLE_PREFIX_CACHE_MB"  # `needle serve --prefix-cache-mb` sets it for the pyfunc it loads
DEFAULT_PREFIX_CACHE_MB = 256.0


def prefix_cache_mb_from_env() -> float:
    """The prefix cache's size in MB from ``NEEDLE_PREFIX_CACHE_MB`` (default 256; 0: off)."""
    raw = os.environ.get(PREFIX_CACHE_ENV)
    try:
        mb = DEFAULT_PREFIX_CACHE_MB if raw is None else float(raw)
    except ValueError:
        raise ValueError(f"{PREFIX_CACHE_ENV}={raw!r} is not a number of megabytes") from None
    if mb < 0:
        raise ValueError(f"{PREFIX_CACHE_ENV}={raw!r}: megabytes cannot be negative")
    return mb


def checked_tools(tools: Any) -> list[dict[str, Any]]:
    """The tools (in any dialect of needle/serve/dialects.py) validated and normalised like a data
    row's; ValueError saying why not."""
    if not isinstance(tools, list):
        raise ValueError(f"invalid tools: expected a JSON list of tools, got {type(tools).__name__}")
    try:
        return parse_row({"query": "?", "tools": normalise_tools(tools), "answers": []}, "tools").tools
    except ValueError as exc:
        raise ValueError(f"invalid tools: {exc}") from None


def error(reason: str, raw: str = "") -> dict[str, Any]:
    return {"error": reason, "raw": raw}


def _as_request(item: Any) -> Request:
    return item if isinstance(item, Request) else Request(query=item[0], tools=item[1])


class Predictor:
    """A loaded model, its chat format and call grammars; thread-safe ``predict``."""

    def __init__(self, loaded: LoadedModel, cfg: EvalConfig | None = None, prefix_cache_mb: float | None = None) -> None:
        self.loaded = loaded
        self.cfg = cfg or EvalConfig()
        self.tok = loaded.tokenizer
        self.fmt = format_for(self.tok)
        self.model = module_for(loaded.model_cfg)
        # The longest prompt served: one that leaves the whole budget when the caller asked for
        # it, else one that leaves room for a single token (module doc).
        self.explicit_budget = cfg is not None and "max_new_tokens" in cfg.model_fields_set
        full = prompt_budget(self.model, self.cfg.max_new_tokens)
        self.budget = full if self.explicit_budget else self.model.cfg.max_len - 1
        self._constraints: Any = None
        self._constraints_error: str | None = None
        self._cv = threading.Condition()  # guards the queue and the busy flag (module doc)
        self._queue: list[_Pending] = []
        self._busy = False
        mb = prefix_cache_mb_from_env() if prefix_cache_mb is None else prefix_cache_mb
        self.prefix_cache = PrefixCache(self.model, int(mb * 2**20)) if mb > 0 else None

    def constraints(self) -> Any:
        """The model's ``Constraints`` (built once), or None when its format has no grammar."""
        if self._constraints is None and self._constraints_error is None:
            try:
                self._constraints = Constraints.for_tokenizer(self.tok, self.fmt)
            except UnsupportedFormat as exc:
                self._constraints_error = str(exc)
        return self._constraints

    def predict(self, requests: Sequence[Any], constrained: bool = True) -> list[Prediction]:
        """Calls, text or an error object per request (``(query, tools)`` or :class:`Request`); module doc."""
        return [a.prediction for a in self.predict_detailed(requests, constrained)]

    def predict_detailed(self, requests: Sequence[Any], constrained: bool = True,
                         on_token: Callable[[int, int], None] | None = None) -> list[Answer]:
        """:meth:`predict`'s predictions with their token counts (module doc); ``on_token(i, id)``
        hears each token of request ``i`` as it is decoded (streaming)."""
        out: list[Answer] = [Answer(error("not decoded"))] * len(requests)
        rows: list[tuple[int, Request, list[int] | Row, Any]] = []
        cons = self.constraints() if constrained else None
        if constrained and cons is None:
            return [Answer(error(f"constrained decoding unavailable: {self._constraints_error}"))] * len(requests)
        for i, item in enumerate(requests):
            req = _as_request(item)
            try:
                prompt, checked = self._prompt(req, i)
                allowed = checked
                if req.only is not None:
                    allowed = [t for t in checked if t["name"] == req.only]
                    if not allowed:
                        raise ValueError(f"tool_choice names {req.only!r}, which is not among the offered tools")
                matcher = cons.matcher(allowed, req.mode) if cons is not None else None
            except (ValueError, ToolSchemaError) as exc:
                out[i] = Answer(error(str(exc)))
                continue
            rows.append((i, req, prompt, matcher))
        if not rows:
            return out
        queries = [p for _, _, p, _ in rows if isinstance(p, Row)]
        encoded = iter(encode_prompts(self.fmt, queries, self.tok) if queries else [])
        fits = []
        for i, req, p, m in rows:
            ids = next(encoded) if isinstance(p, Row) else p
            strict = self.explicit_budget and req.max_tokens is None  # a request's max_tokens is capped, not kept whole
            longest = self.budget if strict else self.model.cfg.max_len - 1
            if len(ids) <= longest:
                fits.append((i, req, ids, m))
            else:
                room = (f"with max_new_tokens={self.cfg.max_new_tokens}" if strict
                        else f"in the model's context of {self.model.cfg.max_len}")
                out[i] = Answer(error(f"prompt has {len(ids)} tokens; at most {longest} fit {room}"))
        if not fits:
            return out
        pending = [_Pending(p, m, self._budget(req), on_token and partial(on_token, i)) for i, req, p, m in fits]
        self._decode_batched(pending)
        for (i, req, _, _), done in zip(fits, pending):
            pred = self._read(self.tok.decode(done.ids), done.finished, req.mode, self._limit(done.prompt, done.budget))
            made, cut = len(done.ids) + done.finished, not done.finished  # the stop id is a decoded token too
            if req.stop and isinstance(pred, dict) and "content" in pred:
                pred, made = self._stopped(pred, done.ids, req.stop, made)
                cut = not pred["finished"]
            out[i] = Answer(pred, len(done.prompt), made, cut)
        return out

    def _budget(self, req: Request) -> int:
        """The decode's budget for ``req``: its ``max_tokens`` (at most what a one-token prompt
        leaves), else the configured one."""
        if req.max_tokens is None:
            return self.cfg.max_new_tokens
        return max(1, min(int(req.max_tokens), self.model.cfg.max_len - 1))

    def _stopped(self, pred: dict[str, Any], ids: list[int], stops: Sequence[str],
                 made: int) -> tuple[dict[str, Any], int]:  # fmt: skip
        """A text answer cut before its first stop string (``finished``), and the tokens decoded up to
        the one that completed the string; unchanged when none occurs."""
        content = pred["content"]
        cuts = [content.find(s) for s in stops if s and s in content]
        if not cuts:
            return pred, made
        lo, hi = 1, len(ids)  # the fewest tokens whose text holds a stop string (binary search)
        while lo < hi:
            mid = (lo + hi) // 2
            text = read_reply(self.fmt, self.tok.decode(ids[:mid])).content or ""
            if any(s and s in text for s in stops):
                hi = mid
            else:
                lo = mid + 1
        return {"content": content[: min(cuts)], "finished": True}, lo

    def _prompt(self, req: Request, i: int) -> tuple[list[int] | Row, list[dict[str, Any]]]:
        """A conversation's prompt ids (or a query's row, encoded in one batch later) and its checked tools."""
        if req.messages is not None:
            tools = normalise_tools(req.tools if req.tools is not None else [])
            row = conversation_row(req.messages, tools, f"request:{i + 1}")
            return conversation_prompt(self.fmt, row, self.tok), row.tools
        query = req.query
        if not isinstance(query, str) or not query.strip():
            raise ValueError("query is empty" if isinstance(query, str) else "query must be a string")
        checked = checked_tools(req.tools)
        return Row(query=query, tools=checked, answers=[], reasoning=None, system=None, source=f"request:{i + 1}"), checked

    def _limit(self, prompt: list[int], budget: int | None = None) -> int:
        """The tokens a prompt's answer may take: the budget, or what is left of the context."""
        return min(self.cfg.max_new_tokens if budget is None else budget, self.model.cfg.max_len - len(prompt))

    def _read(self, text: str, finished: bool, mode: str, limit: int) -> Prediction:
        """One decoded turn (of at most ``limit`` tokens) as calls, ``{"content", "finished"}`` or an error object."""
        late = "" if finished else f"no {self.tok.decode([self.tok.end_id])} within {limit} tokens; "
        if mode == "calls":
            parsed = self.fmt.parse(text)
            if parsed.ok:
                return parsed.calls
            reason = str(parsed.error)
        else:
            reply = read_reply(self.fmt, text)
            if reply.error is None:
                return reply.calls if reply.calls is not None else {"content": reply.content, "finished": finished}
            reason = reply.error
        return error(late + reason, text)

    def _decode_batched(self, pending: list["_Pending"]) -> None:
        """Decode ``pending`` rows, together with whatever other callers queued meanwhile."""
        with self._cv:
            self._queue.extend(pending)
        while True:
            with self._cv:
                while self._busy and not all(p.ready for p in pending):
                    self._cv.wait()
                if all(p.ready for p in pending):
                    break
                self._busy = True  # this caller decodes the queue's head for everyone
                size = self.cfg.batch_size
                budget = self._queue[0].budget  # one budget per decode: the head's, and the rows that share it
                batch = [p for p in self._queue if p.budget == budget][:size]
                taken = {id(p) for p in batch}
                self._queue = [p for p in self._queue if id(p) not in taken]
            try:
                matchers = [p.matcher for p in batch]
                constrained = any(m is not None for m in matchers)
                hear = [p.on_token for p in batch]
                gen = generate_detailed(
                    self.model, self.loaded.params, [p.prompt for p in batch], max_new_tokens=budget,
                    end_id=self.tok.stop_ids, pad_id=self.tok.pad_id, batch_size=size, overflow="shrink",
                    matchers=matchers if constrained else None, constraints=self._constraints if constrained else None,
                    prefix_cache=self.prefix_cache,
                    on_token=(lambda i, t: hear[i] and hear[i](t)) if any(hear) else None,
                )  # fmt: skip
                for p, ids, finished in zip(batch, gen.ids, gen.finished):
                    p.ids, p.finished, p.ready = ids, finished, True
            except Exception as exc:  # noqa: BLE001  # every waiting caller gets the error, none hangs
                for p in batch:
                    p.error, p.ready = exc, True
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()
        for p in pending:
            if p.error is not None:
                raise p.error


class _Pending:
    """One row waiting for the batched decoder, and its result."""

    __slots__ = ("prompt", "matcher", "budget", "on_token", "ids", "finished", "ready", "error")

    def __init__(self, prompt: list[int], matcher: Any, budget: int, on_token: Callable[[int], Any] | None) -> None:
        self.prompt, self.matcher, self.budget, self.on_token = prompt, matcher, budget, on_token
        self.ids: list[int] = []
        self.finished = False
        self.ready = False
        self.error: Exception | None = None
