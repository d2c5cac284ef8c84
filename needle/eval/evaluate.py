"""Evaluate an exported model on rows: render → decode → parse → score, plus teacher-forced loss.

``evaluate_model(model, split, cfg)`` takes an exported model directory (or a ``LoadedModel``)
and a split: a prepared ``datasets.Dataset`` (needle.data.prepare columns) or a list of ``Row``
(or raw row dicts, validated with ``parse_row``). It renders every prompt in the model's chat
format (``needle.data.chat.format_for(tokenizer)``: needle's template or the model's own Jinja
template), greedily decodes it with the KV cache until a stop id (needle/eval/decode.py), parses
the emitted calls with the format's parser and scores them (needle/eval/metrics.py).
A conversation row is evaluated turn by turn (needle/data/turns.py): each assistant turn
continues from the true history before it; turns that answer in words are scored by
needle/eval/turn_metrics.py (``answers_in_text``, ``text_rouge_l``), whole conversations by
``conversation_exact_match``, and their examples carry the turn's message index (``turn``).
When the split carries ``ids``/``loss_mask`` it also reports ``val_loss`` (mean masked token
cross-entropy of the target tokens) and ``perplexity``; otherwise those two keys are None.

Besides :data:`needle.eval.metrics.METRIC_KEYS`, ``metrics`` always holds ``val_loss``,
``perplexity``, ``n_prompts_truncated`` (prompts of ``max_len`` tokens or more, left-truncated
to leave ``max_new_tokens`` of room), ``n_budget_shrunk`` (prompts longer than ``max_len -
max_new_tokens``, kept whole but given only the remaining context to answer in) and
``n_unfinished`` (rows that ran out of tokens without a stop id).

With ``cfg.constrained`` (the default) every row is decoded a second time under the grammar of
its offered tools (needle/eval/constrain.py) and ``metrics`` also holds the same keys prefixed
``constrained_`` (``constrained_valid_call_rate``, ``constrained_exact_match``, …,
``constrained_rows_per_s``, ``constrained_n_steered``), the per-row table of that decode in
``constrained_examples``. The unprefixed keys stay free decoding's, so gates and history compare
like with like. A chat format without a call grammar (FunctionGemma's) skips the second decode
and says so in ``constrained_skipped``.

    from needle.config import EvalConfig
    from needle.eval.evaluate import evaluate_model
    result = evaluate_model("runs/tuned/model", data.splits["test"], EvalConfig(max_rows=200))
    result.metrics["exact_match"], result.rows_per_s
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import datasets
import jax

from needle.config import EvalConfig
from needle.data.batching import BatchPlan
from needle.data.chat import format_for
from needle.data.parse import ParsedCall
from needle.data.render import compact_json, encode_prompts
from needle.data.schema import Row, parse_row, split_source
from needle.data.turns import Turn, conversation_prompt, expand_turns
from needle.errors import DataError, DataIssue
from needle.eval.constrain import Constraints, UnsupportedFormat
from needle.eval.decode import generate_detailed, prompt_budget
from needle.eval.metrics import score_predictions
from needle.eval.reply import read_reply
from needle.eval.turn_metrics import score_conversations, score_text_turns
from needle.hardware import BackendSettings, settings_for
from needle.model.factory import LoadedModel, module_for
from needle.model.io import load_model
from needle.model.decoder.transformer import Transformer
from needle.train.loss import model_loss_sum


# Counts that decoding does not change: reported once, not again under ``constrained_``.
_COUNTS = ("n", "n_with_calls", "n_offtopic", "n_turns", "n_text_turns", "n_conversations")


@dataclass(frozen=True)
class EvalResult:
    """Aggregate metrics, one dict per evaluated row, and timing.

    ``wall_s`` covers the whole call (loading, compiling, decoding, loss); ``tokens_per_s`` and
    ``rows_per_s`` are over the decode alone (compilation included: it is part of every eval).
    """

    metrics: dict[str, Any]
    examples: list[dict[str, Any]]
    wall_s: float
    tokens_per_s: float
    rows_per_s: float
    constrained_examples: list[dict[str, Any]] | None = None


def resolve_model(model: str | Path | LoadedModel) -> LoadedModel:
    """A ``LoadedModel`` as is, or the exported model read from a directory."""
    return model if isinstance(model, LoadedModel) else load_model(model)


def rows_of(split: datasets.Dataset | Sequence[Row | Mapping[str, Any]], max_rows: int | None = None) -> list[Row]:
    """The split's rows as validated ``Row`` objects (at most ``max_rows``); bad rows → DataError."""
    rows: list[Row] = []
    issues: list[DataIssue] = []
    for i, record in enumerate(split):
        if max_rows is not None and i >= max_rows:
            break
        if isinstance(record, Row):
            rows.append(record)
            continue
        source = str(record.get("source") or f"split:{i}")
        try:
            rows.append(parse_row(dict(record), source))
        except ValueError as exc:
            issues.append(DataIssue(*split_source(source), str(exc)))
    if issues:
        raise DataError(issues)
    return rows


@partial(jax.jit, static_argnames="model")
def _loss_sum(model: Transformer, params: Any, batch: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
    # The settings' loss_chunk > 0: logits a chunk of tokens at a time, never [B, T, V].
    settings = getattr(model, "settings", None) or settings_for("cpu")
    return model_loss_sum(model, {"params": params}, batch, settings.loss_chunk)


def compute_val_loss(
    model: Transformer, params: Any, split: datasets.Dataset, batch_size: int, pad_id: int
) -> float | None:
    """Mean masked cross-entropy over the split's target tokens (None when it has none)."""
    plan = BatchPlan(split, batch_size=batch_size, max_len=model.cfg.max_len, seed=0, pad_id=pad_id)
    total, tokens = 0.0, 0.0
    for batch in plan.eval_batches():
        loss, count = _loss_sum(model, params, {k: batch[k] for k in ("inputs", "targets", "mask")})
        total, tokens = total + float(loss), tokens + float(count)
    return total / tokens if tokens else None


def fit_prompts(
    prompts: list[list[int]], model: Any, max_new_tokens: int, keep_first: bool = False
) -> tuple[list[list[int]], int]:
    """Left-truncate prompts that fill the whole context to leave ``max_new_tokens`` of room.

    Shorter prompts stay whole (the decoder shrinks their budget instead); returns the prompts
    and how many were cut, which the metrics report. ``keep_first`` keeps a BOS id in front
    (formats that add one, Needle 3's).
    """
    budget = prompt_budget(model, max_new_tokens)
    too_long = [len(p) >= model.cfg.max_len for p in prompts]

    def cut(p: list[int]) -> list[int]:
        return p[:1] + p[len(p) - budget + 1 :] if keep_first else p[-budget:]

    return [cut(p) if c else p for p, c in zip(prompts, too_long)], sum(too_long)


def _example_row(row: Row, parsed: ParsedCall, text: str, finished: bool, flags: dict[str, Any]) -> dict[str, Any]:
    predicted = compact_json(parsed.calls) if parsed.ok else text
    return {
        "source": row.source,
        "query": row.query,
        "expected": compact_json(row.answers),
        "predicted": predicted,
        "parse_error": parsed.error,
        "reasoning": parsed.reasoning,
        "finished": finished,
        **flags,
    }


def evaluate_model(
    model_dir_or_loaded: str | Path | LoadedModel,
    split: datasets.Dataset | Sequence[Row | Mapping[str, Any]],
    cfg: EvalConfig,
    *,
    settings: BackendSettings | None = None,
) -> EvalResult:
    """Decode, parse and score every row of ``split`` (see the module doc)."""
    started = time.perf_counter()
    loaded = resolve_model(model_dir_or_loaded)
    tok = loaded.tokenizer
    fmt = format_for(tok)
    model = module_for(loaded.model_cfg, None, settings)
    rows = rows_of(split, cfg.max_rows)
    turns = expand_turns(rows)
    keep_bos = hasattr(fmt, "encode_prompt")
    prompts, n_cut = fit_prompts(_prompts(fmt, turns, tok), model, cfg.max_new_tokens, keep_first=keep_bos)
    free = _decode_and_score(model, loaded.params, tok, fmt, turns, prompts, cfg, None)
    scored, examples, gen, decode_s = free
    extra: dict[str, Any] = {}
    constrained_examples = None
    if cfg.constrained:
        extra, constrained_examples = _constrained_metrics(model, loaded.params, tok, fmt, turns, prompts, cfg)
    val_loss = None
    if isinstance(split, datasets.Dataset) and {"ids", "loss_mask"} <= set(split.column_names):
        subset = split.select(range(len(rows))) if cfg.max_rows else split
        val_loss = compute_val_loss(model, loaded.params, subset, cfg.batch_size, tok.pad_id)
    metrics = {
        **scored,
        "val_loss": val_loss,
        "perplexity": math.exp(min(val_loss, 700.0)) if val_loss is not None else None,
        "n_prompts_truncated": n_cut,
        "n_budget_shrunk": gen.n_shrunk,
        "n_unfinished": sum(not f for f in gen.finished),
        **extra,
    }
    return EvalResult(
        metrics=metrics,
        examples=examples,
        wall_s=time.perf_counter() - started,
        tokens_per_s=gen.n_tokens / decode_s if decode_s > 0 else 0.0,
        rows_per_s=len(turns) / decode_s if decode_s > 0 else 0.0,
        constrained_examples=constrained_examples,
    )


def _prompts(fmt: Any, turns: list[Turn], tok: Any) -> list[list[int]]:
    """Each turn's prompt: a query/answers row's as it always was, a conversation turn's its true
    history (needle/data/turns.py ``conversation_prompt``)."""
    single = [t.row for t in turns if t.row.messages is None]
    encoded = iter(encode_prompts(fmt, single, tok) if single else [])
    return [next(encoded) if t.row.messages is None else conversation_prompt(fmt, t.row, tok) for t in turns]


def _decode_and_score(model: Transformer, params: Any, tok: Any, fmt: Any, turns: list[Turn], prompts: list[list[int]],
                      cfg: EvalConfig, constraints: Any) -> tuple[dict[str, Any], list[dict[str, Any]], Any, float]:  # fmt: skip
    """Decode (free, or under ``constraints``), parse and score: (metrics, examples, generation, decode seconds).

    Turns that call (or answer ``[]``) are scored as calls; turns that answer in words by
    needle/eval/turn_metrics.py; a conversation turn is decoded under the ``auto`` grammar (calls
    or text), a query/answers row under ``calls`` as before.
    """
    matchers = None
    if constraints is not None:
        matchers = [constraints.matcher(t.row.tools, "calls" if t.row.messages is None else "auto") for t in turns]
    start = time.perf_counter()
    gen = generate_detailed(
        model,
        params,
        prompts,
        max_new_tokens=cfg.max_new_tokens,
        end_id=tok.stop_ids,
        pad_id=tok.pad_id,
        batch_size=cfg.batch_size,
        overflow="shrink",
        matchers=matchers,
        constraints=constraints,
    )
    decode_s = time.perf_counter() - start
    texts = [tok.decode(ids) for ids in gen.ids]
    calls = [i for i, t in enumerate(turns) if t.kind != "text"]
    parsed = {i: fmt.parse(texts[i]) for i in calls}
    scored = score_predictions(
        [{"tools": turns[i].row.tools, "expected": turns[i].row.answers, "predicted": parsed[i].calls} for i in calls]
    )
    call_flags = dict(zip(calls, scored.pop("per_example")))
    examples = [
        _example_row(turns[i].row, parsed[i], texts[i], gen.finished[i], call_flags[i]) if i in call_flags else {}
        for i in range(len(turns))
    ]
    if any(t.row.messages is not None for t in turns):
        scored.update(_score_turns(fmt, turns, texts, gen.finished, call_flags, examples))
    return scored, examples, gen, decode_s


def _score_turns(fmt: Any, turns: list[Turn], texts: list[str], finished: list[bool],
                 call_flags: dict[int, dict[str, Any]], examples: list[dict[str, Any]]) -> dict[str, Any]:  # fmt: skip
    """The multi-turn metrics (turn_metrics.py); fills the text turns' examples and tags each
    conversation turn's example with its message index."""
    text_idx = [i for i, t in enumerate(turns) if t.kind == "text"]
    replies = {i: read_reply(fmt, texts[i]) for i in text_idx}
    text = score_text_turns(
        [{"reference": turns[i].text, "content": replies[i].content, "calls": replies[i].calls} for i in text_idx]
    )
    for i, flags in zip(text_idx, text.pop("per_example")):
        r = replies[i]
        predicted = r.content if r.content is not None else compact_json(r.calls) if r.calls else texts[i]
        examples[i] = {"source": turns[i].row.source, "query": turns[i].row.query, "expected": turns[i].text,
                       "predicted": predicted, "parse_error": r.error, "reasoning": None, "finished": finished[i],
                       **flags}  # fmt: skip
        call_flags[i] = {"exact": flags["answered_in_text"]}
    for i, t in enumerate(turns):
        if t.row.messages is not None:
            examples[i] = {"turn": t.message, **examples[i]}
    pairs = [(t.conversation, call_flags[i]["exact"]) for i, t in enumerate(turns) if t.row.messages is not None]
    return {"n_turns": len(turns), **text, **score_conversations(pairs)}


def _constrained_metrics(model: Transformer, params: Any, tok: Any, fmt: Any, turns: list[Turn],
                         prompts: list[list[int]], cfg: EvalConfig) -> tuple[dict[str, Any], list[dict[str, Any]] | None]:  # fmt: skip
    """The ``constrained_*`` metrics and examples (module doc); a format without a grammar says why."""
    try:
        constraints = Constraints.for_tokenizer(tok, fmt)
    except UnsupportedFormat as exc:
        return {"constrained_skipped": str(exc)}, None
    scored, examples, gen, decode_s = _decode_and_score(model, params, tok, fmt, turns, prompts, cfg, constraints)
    metrics = {f"constrained_{k}": v for k, v in scored.items() if k not in _COUNTS}
    metrics.update(
        constrained_n_unfinished=sum(not f for f in gen.finished),
        constrained_n_steered=gen.n_steered,
        constrained_rows_per_s=len(turns) / decode_s if decode_s > 0 else 0.0,
        constrained_tokens_per_s=gen.n_tokens / decode_s if decode_s > 0 else 0.0,
    )
    return metrics, examples

