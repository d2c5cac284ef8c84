"""One loaded model answering tool-call requests, each with its own tools: what predict and serving share.

``Predictor(loaded)`` keeps the model, its chat format and (lazily) its call grammars
(needle/serve/constrain.py, compiled once per tool set). ``predict(requests)`` takes
``(query, tools)`` pairs and returns, per request, the parsed call list or an error object
``{"error": reason, "raw": generated text}``; a request that cannot be served (bad tools, empty
query, a prompt too long for the context, a schema the grammar cannot take) gets its error
without stopping the others.

Concurrent callers (the scoring server runs each request in a thread) are batched: while one
decode runs, newly arrived rows queue; the next caller to find the decoder idle decodes every
queued row (up to ``batch_size``, constrained and free rows together: matchers are per row) and
hands each caller its own results. Four concurrent one-query clients thus share one decode
instead of waiting for four.

    p = Predictor(load_model("runs/tuned/model"))
    p.predict([("turn on the lights", tools)], constrained=True)
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from needle.config import EvalConfig
from needle.data.chat import format_for
from needle.data.render import encode_prompts
from needle.data.schema import Row, parse_row
from needle.eval.decode import generate_detailed, prompt_budget
from needle.model.io import LoadedModel
from needle.model.factory import module_for

Prediction = list[dict[str, Any]] | dict[str, Any]


def checked_tools(tools: Any) -> list[dict[str, Any]]:
    """The tools validated (and normalised) like a data row's; ValueError saying why not."""
    if not isinstance(tools, list):
        raise ValueError(f"invalid tools: expected a JSON list of tools, got {type(tools).__name__}")
    try:
        return parse_row({"query": "?", "tools": tools, "answers": []}, "tools").tools
    except ValueError as exc:
        raise ValueError(f"invalid tools: {exc}") from None


def error(reason: str, raw: str = "") -> dict[str, Any]:
    return {"error": reason, "raw": raw}


class Predictor:
    """A loaded model, its chat format and call grammars; thread-safe ``predict``."""

    def __init__(self, loaded: LoadedModel, cfg: EvalConfig | None = None) -> None:
        self.loaded = loaded
        self.cfg = cfg or EvalConfig()
        self.tok = loaded.tokenizer
        self.fmt = format_for(self.tok)
        self.model = module_for(loaded.model_cfg)
        self.budget = prompt_budget(self.model, self.cfg.max_new_tokens)
        self._constraints: Any = None
        self._constraints_error: str | None = None
        self._cv = threading.Condition()  # guards the queue and the busy flag (module doc)
        self._queue: list[_Pending] = []
        self._busy = False

    def constraints(self) -> Any:
        """The model's ``Constraints`` (built once), or None when its format has no grammar."""
        if self._constraints is None and self._constraints_error is None:
            from needle.eval.constrain import Constraints, UnsupportedFormat

            try:
                self._constraints = Constraints.for_tokenizer(self.tok, self.fmt)
            except UnsupportedFormat as exc:
                self._constraints_error = str(exc)
        return self._constraints

    def predict(self, requests: Sequence[tuple[Any, Any]], constrained: bool = True) -> list[Prediction]:
        """Calls (or an error object) per ``(query, tools)`` request; see the module doc."""
        from needle.eval.constrain import ToolSchemaError

        out: list[Prediction] = [error("not decoded")] * len(requests)
        rows: list[tuple[int, Row, Any]] = []
        cons = self.constraints() if constrained else None
        if constrained and cons is None:
            return [error(f"constrained decoding unavailable: {self._constraints_error}")] * len(requests)
        for i, (query, tools) in enumerate(requests):
            try:
                if not isinstance(query, str) or not query.strip():
                    raise ValueError("query is empty" if isinstance(query, str) else "query must be a string")
                checked = checked_tools(tools)
                matcher = cons.matcher(checked) if cons is not None else None
            except (ValueError, ToolSchemaError) as exc:
                out[i] = error(str(exc))
                continue
            row = Row(query=query, tools=checked, answers=[], reasoning=None, system=None, source=f"request:{i + 1}")
            rows.append((i, row, matcher))
        if not rows:
            return out
        prompts = encode_prompts(self.fmt, [r for _, r, _ in rows], self.tok)
        fits = []
        for (i, _, m), p in zip(rows, prompts):
            if len(p) <= self.budget:
                fits.append((i, p, m))
            else:
                out[i] = error(f"prompt has {len(p)} tokens; at most {self.budget} fit with "
                               f"max_new_tokens={self.cfg.max_new_tokens}")  # fmt: skip
        if not fits:
            return out
        pending = [_Pending(p, m) for _, p, m in fits]
        self._decode_batched(pending)
        end_name = self.tok.decode([self.tok.end_id])
        for (i, _, _), done in zip(fits, pending):
            ids, finished = done.ids, done.finished
            text = self.tok.decode(ids)
            parsed = self.fmt.parse(text)
            if parsed.ok:
                out[i] = parsed.calls
            else:
                why = parsed.error if finished else f"no {end_name} within {self.cfg.max_new_tokens} tokens; {parsed.error}"
                out[i] = error(why, text)
        return out

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
                batch, self._queue = self._queue[:size], self._queue[size:]
            try:
                matchers = [p.matcher for p in batch]
                constrained = any(m is not None for m in matchers)
                gen = generate_detailed(
                    self.model, self.loaded.params, [p.prompt for p in batch], max_new_tokens=self.cfg.max_new_tokens,
                    end_id=self.tok.stop_ids, pad_id=self.tok.pad_id, batch_size=size,
                    matchers=matchers if constrained else None, constraints=self._constraints if constrained else None,
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

    __slots__ = ("prompt", "matcher", "ids", "finished", "ready", "error")

    def __init__(self, prompt: list[int], matcher: Any) -> None:
        self.prompt, self.matcher = prompt, matcher
        self.ids: list[int] = []
        self.finished = False
        self.ready = False
        self.error: Exception | None = None
