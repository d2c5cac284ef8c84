"""Greedy decoding with the model's KV cache, in a small fixed set of compiled shapes.

``generate(model, params, prompts, max_new_tokens=…, end_id=…, pad_id=…, batch_size=…)``
returns the generated ids of each prompt, up to and excluding the first stop id. ``end_id`` is
one id or a sequence of them (``tok.stop_ids``: e.g. Qwen's ``<|im_end|>`` and
``<|endoftext|>``); generation stops at whichever comes first.

How it stays fast and compiles few programs:

- prompts are sorted by length and grouped into batches of ``batch_size`` (a smaller power of two
  when there are fewer prompts), the last batch padded with dead rows;
- each batch is right-padded to a power-of-two bucket ``P`` (``needle.data.batching.bucket_for``:
  at least 16, at most the model's ``max_len``) and gets a cache of ``min(max_len, P +
  max_new_tokens)`` slots, so there is one compiled program per (batch, bucket) pair;
- one jitted call prefills the whole bucket (ragged rows read their logits at ``n_b - 1``, see
  needle/model/decoder/transformer.py: only those positions go through the output layer, and prefill
  attention runs in query blocks) and then runs a ``lax.while_loop`` of one-token cached steps that
  stops as soon as every row has emitted a stop id or used its token budget.

A prompt longer than ``max_len - max_new_tokens`` cannot fit a full-length answer. By default
(``overflow="error"``) ``generate`` raises ``ValueError`` naming it; ``overflow="shrink"`` keeps
the prompt whole and lets that row generate only ``max_len - len(prompt)`` tokens (counted in
``Generation.n_shrunk``). A prompt of ``max_len`` tokens or more is always an error (evaluation
left-truncates those itself, with a count).
With ``matchers`` (one grammar matcher or None per prompt, needle/eval/constrain.py), a batch that
holds a constrained row decodes on a host loop instead: one jitted prefill, then one jitted cached
step per token, queued before the host reads the last token back (``_decode_host``); the logits
are masked on the device with the rows' bitmasks (``[rows, ceil(vocab/32)]`` int32, filled by
the matchers in parallel on the host) before each argmax, and each chosen token is fed back to
its row's matcher. ``on_token`` (streaming) takes that host loop too,
unmasked for free rows; other free batches keep the single compiled loop. A constrained row with
``CLOSE_RESERVE`` tokens of budget left is steered to close its call list once it has opened one.
With a ``prefix_cache`` (needle/serve/prefix_cache.py; the server keeps one) a prompt whose
leading 16-token blocks were prefilled before starts from those cached keys and values, and only
the rest is prefilled, at explicit positions; without a hit the path is the one above.
``generate_uncached`` is the slow reference (a full forward pass per token) for the tests.

    from needle.eval.decode import generate
    out = generate(model, params, [tok.encode(prompt)], max_new_tokens=96,
                   end_id=tok.end_id, pad_id=tok.pad_id, batch_size=32)
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from needle.data.batching import bucket_for
from needle.eval.constrain import CLOSE_RESERVE, BatchMasks
from needle.model.lora import in_compute_dtype
from needle.model.decoder.scan import stack_model_layers
from needle.model.decoder.transformer import Transformer, init_cache

Overflow = Literal["error", "shrink"]
StopIds = int | Sequence[int]


def stop_array(end_id: StopIds) -> np.ndarray:
    """The stop ids as a non-empty int32 vector (a single int is a one-element vector)."""
    ids = np.atleast_1d(np.asarray(end_id, dtype=np.int32)).ravel()
    if ids.size == 0:
        raise ValueError("end_id: at least one stop id is needed")
    return ids


@dataclass(frozen=True)
class Generation:
    """Generated ids per prompt (the stop id excluded), whether each emitted a stop id, the
    generated tokens summed over prompts (stop ids included), how many prompts had their
    token budget shrunk to fit ``max_len``, and how many constrained rows were steered to close
    their call list near the end of their budget."""

    ids: list[list[int]]
    finished: list[bool]
    n_tokens: int
    n_shrunk: int = 0
    n_steered: int = 0


def prompt_budget(model: Transformer, max_new_tokens: int) -> int:
    """The longest prompt that leaves room for ``max_new_tokens`` in the model's context."""
    budget = model.cfg.max_len - max_new_tokens
    if budget < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} leaves no room for a prompt in max_len={model.cfg.max_len}")
    return budget


def _check_prompts(model: Transformer, prompts: list[list[int]], max_new_tokens: int, overflow: Overflow) -> None:
    if overflow not in ("error", "shrink"):
        raise ValueError(f"overflow must be 'error' or 'shrink', got {overflow!r}")
    budget = prompt_budget(model, max_new_tokens)
    # "shrink" still needs room for one generated token.
    limit = budget if overflow == "error" else model.cfg.max_len - 1
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompt {i} is empty")
        if len(p) > limit:
            raise ValueError(
                f"prompt {i} has {len(p)} tokens; with max_len={model.cfg.max_len} and "
                f"max_new_tokens={max_new_tokens} at most {limit} fit (overflow={overflow!r}; "
                "shorten the prompt or lower max_new_tokens)"
            )


def _prefill(
    model: Transformer, params: Any, cache: Any, tokens: jax.Array, lengths: jax.Array, starts: jax.Array | None = None
) -> tuple[jax.Array, Any]:  # fmt: skip
    """Fill the cache with ``tokens[B, P]``; return each row's next-token logits ``[B, V]`` (at
    position ``lengths - 1``) and the cache. Only those B positions go through the output layer:
    the final hidden states are gathered first (``return_hidden``), never ``[B, P, V]`` logits.
    Settings with ``loss_chunk=0`` keep the path before issue 20 (full logits, then pick).
    With ``starts`` (a reused prefix per row, already in the cache) ``tokens`` are the rest of
    each prompt, fed at slots ``starts + t``; ``lengths`` stay whole prompts'."""
    positions = None if starts is None else starts[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
    at = (lengths if starts is None else lengths - starts) - 1
    settings = getattr(model, "settings", None)
    if settings is not None and getattr(settings, "loss_chunk", 1) == 0:
        logits, upd = model.apply({"params": params, "cache": cache}, tokens, positions, decode=True, mutable=["cache"])
        return jnp.take_along_axis(logits, at[:, None, None], axis=1)[:, 0], upd["cache"]
    hidden, upd = model.apply(
        {"params": params, "cache": cache}, tokens, positions, decode=True, return_hidden=True, mutable=["cache"]
    )
    last = jnp.take_along_axis(hidden, at[:, None, None], axis=1)[:, 0]
    return model.apply({"params": params}, last, method="logits"), upd["cache"]


@partial(jax.jit, static_argnames=("model", "max_new"))
def _decode_batch(
    model: Transformer,
    params: Any,
    cache: Any,
    tokens: jax.Array,
    lengths: jax.Array,
    limits: jax.Array,
    stop_ids: jax.Array,
    pad_id: jax.Array,
    starts: jax.Array | None = None,
    *,
    max_new: int,
) -> tuple[jax.Array, Any]:
    """Prefill ``tokens[B, P]`` and decode greedily; return ``out[B, max_new]`` (pad after the
    end) and the cache, whose first ``lengths`` slots hold the prompts (for a prefix cache).

    ``stop_ids[K]`` is traced: one compiled program per number of stop ids, not per tokenizer.
    """
    rows = tokens.shape[0]
    last, upd = _prefill(model, params, cache, tokens, lengths, starts)
    first = jnp.argmax(last, axis=-1).astype(jnp.int32)
    out = jnp.full((rows, max_new), pad_id, jnp.int32).at[:, 0].set(first)
    # A row with limit 0 is batch padding; limit 1 has spent its budget on ``first``.
    done = jnp.isin(first, stop_ids) | (limits <= 1)

    def keep_going(state: tuple) -> jax.Array:
        step, _, _, _, _, done = state
        return (step < max_new) & ~jnp.all(done)

    def one_step(state: tuple) -> tuple:
        step, tok, pos, cache, out, done = state
        logits, upd = model.apply(
            {"params": params, "cache": cache}, tok[:, None], pos[:, None], decode=True, mutable=["cache"]
        )
        nxt = jnp.where(done, pad_id, jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32))
        out = out.at[:, step].set(nxt)
        return step + 1, nxt, pos + 1, upd["cache"], out, done | jnp.isin(nxt, stop_ids) | (step + 1 >= limits)

    # Answer token k is fed at slot n_b + k, right after the prompt's last real slot.
    state = (jnp.int32(1), first, lengths.astype(jnp.int32), upd, out, done)
    final = jax.lax.while_loop(keep_going, one_step, state)
    return final[4], final[3]


def _masked_argmax(logits: jax.Array, bits: jax.Array, closing: jax.Array, scores: jax.Array) -> jax.Array:
    """Greedy pick among the tokens whose bit is set in ``bits[B, W]`` (bit ``i % 32`` of word
    ``i // 32``); a row with ``closing`` 1 (outside a JSON string) or 2 (inside one) picks the
    allowed token of highest closing ``scores[closing - 1]`` first."""
    vocab = logits.shape[-1]
    idx = jnp.arange(vocab, dtype=jnp.int32)
    allowed = ((bits[:, idx // 32] >> (idx % 32)) & 1).astype(bool)
    logits = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    # log-probs are >= -1e4 in practice: a closing score of 1 outranks any difference in them.
    bonus = jnp.where((closing == 2)[:, None], scores[1, None, :vocab], scores[0, None, :vocab])
    logits = logits + jnp.where((closing > 0)[:, None], bonus * 1e5, 0.0)
    return jnp.argmax(jnp.where(allowed, logits, -jnp.inf), axis=-1).astype(jnp.int32)


@partial(jax.jit, static_argnames="model", donate_argnames="cache")
def _prefill_masked(model: Transformer, params: Any, cache: Any, tokens: jax.Array, lengths: jax.Array,
                    bits: jax.Array, closing: jax.Array, scores: jax.Array,
                    starts: jax.Array | None = None) -> tuple[jax.Array, Any]:  # fmt: skip
    last, cache = _prefill(model, params, cache, tokens, lengths, starts)
    return _masked_argmax(last, bits, closing, scores), cache


@partial(jax.jit, static_argnames="model", donate_argnames="cache")
def _step_logits(model: Transformer, params: Any, cache: Any, tok: jax.Array, pos: jax.Array) -> tuple[jax.Array, Any]:
    """One cached step's logits ``[B, V]``: the constrained loop picks from them once the host has
    the masks, so this runs while the host brings the last token back and updates the matchers."""
    logits, upd = model.apply({"params": params, "cache": cache}, tok[:, None], pos[:, None], decode=True,
                              mutable=["cache"])  # fmt: skip
    return logits[:, 0], upd["cache"]


_pick_masked = jax.jit(_masked_argmax)  # the constrained loop's pick, once the host has the masks


@partial(jax.jit, static_argnames="model", donate_argnames="cache")
def _prefill_free(model: Transformer, params: Any, cache: Any, tokens: jax.Array, lengths: jax.Array,
                  starts: jax.Array | None = None) -> tuple[jax.Array, Any]:  # fmt: skip
    last, cache = _prefill(model, params, cache, tokens, lengths, starts)
    return jnp.argmax(last, axis=-1).astype(jnp.int32), cache


@partial(jax.jit, static_argnames="model", donate_argnames="cache")
def _step_free(model: Transformer, params: Any, cache: Any, tok: jax.Array, pos: jax.Array) -> tuple[jax.Array, Any]:
    logits, upd = model.apply({"params": params, "cache": cache}, tok[:, None], pos[:, None], decode=True,
                              mutable=["cache"])  # fmt: skip
    return jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32), upd["cache"]


def _decode_host(
    model: Transformer, params: Any, cache: Any, tokens: np.ndarray, lengths: np.ndarray, limits: np.ndarray,
    stops: np.ndarray, pad_id: int, max_new: int, matchers: list[Any], constraints: Any,
    starts: np.ndarray | None = None, on_token: Callable[[int, int], None] | None = None,
) -> tuple[np.ndarray, int, Any]:  # fmt: skip
    """The host-loop twin of :func:`_decode_batch`: one jitted step per token, masked for rows with
    a matcher, ``on_token(row, id)`` as each live row's token is chosen (its stop id included).
    Returns the tokens, how many rows were steered to close (module doc: only once a row has
    opened a call list, so text, or a list not yet begun, is what any budget gives) and the cache.

    Each step's forward pass goes to the device before the previous token comes back to the host:
    it reads that token where the device left it, so the device computes while the host waits
    for the token (a round trip is about 1.1 ms on a TPU v5e, ``bench.decode_parts``) and updates
    the matchers; only the masked pick waits for the masks. Rows already done are fed their raw
    pick instead of ``pad_id``: it only reaches their own cache slots past the answer."""
    constrained = np.array([m is not None for m in matchers]) if matchers else np.zeros(len(limits), bool)
    rows, masked = tokens.shape[0], bool(constrained.any())
    if masked:
        masks = BatchMasks(matchers, constraints.tok_vocab, model.cfg.vocab_size, stops.tolist())
        # On the device once, not sent with every step ([2, V] float32: 0.4 MB at a 49k vocabulary).
        scores, token_bytes = jnp.asarray(constraints.close_scores(model.cfg.vocab_size)), constraints.token_bytes()
        tok, cache = _prefill_masked(model, params, cache, tokens, lengths, masks.bits, np.zeros(rows, np.int32),
                                     scores, starts)  # fmt: skip
    else:
        tok, cache = _prefill_free(model, params, cache, tokens, lengths, starts)
    out = np.full((rows, max_new), pad_id, np.int32)
    done = limits < 1  # batch padding: no tokens, no callbacks
    opened, steered = np.zeros(rows, bool), np.zeros(rows, bool)
    pos = lengths.astype(np.int32)
    for step in range(max_new):
        ahead = step + 1 < max_new  # the next token's forward pass, queued before this token is read
        if ahead and masked:
            logits, cache = _step_logits(model, params, cache, tok, pos)
        elif ahead:
            tok_next, cache = _step_free(model, params, cache, tok, pos)
        nxt = np.asarray(tok).astype(np.int32)
        if step:
            nxt = np.where(done, pad_id, nxt).astype(np.int32)
        out[:, step] = nxt
        for r in np.flatnonzero(~done) if on_token is not None else ():
            on_token(int(r), int(nxt[r]))
        done = done | np.isin(nxt, stops) | (step + 1 >= limits)
        if done.all() or not ahead:
            break
        if masked:
            masks.update(nxt, done, token_bytes)
            near_end = constrained & ~done & (limits - (step + 1) <= CLOSE_RESERVE)
            for r in np.flatnonzero(near_end & ~opened):
                opened[r] = constraints.opens_call_list(out[r, : step + 1])
            steered |= near_end & opened
            closing = np.where(near_end & opened, np.where(masks.in_string, 2, 1), 0).astype(np.int32)
            tok = _pick_masked(logits, masks.bits, closing, scores)
        else:
            tok = tok_next
        pos = pos + 1
    return out, int(steered.sum()), cache


def decoding_params(model: Transformer, params: Any) -> Any:
    """The weights as the decoding loop reads them: matrices in the compute dtype and, for a
    scanned model, the blocks stacked (needle/model/decoder/scan.py), so no step re-stacks or re-casts them."""
    settings = getattr(model, "settings", None)
    if isinstance(model, Transformer) and settings is not None and settings.scan_layers:
        params = stack_model_layers(params, model.cfg)
    return in_compute_dtype(params, settings)


def _cut_at_end(row: np.ndarray, stop_ids: np.ndarray) -> tuple[list[int], bool, int]:
    """(ids before the first stop id, whether one occurred, tokens generated including it)."""
    hits = np.flatnonzero(np.isin(row, stop_ids))
    if hits.size:
        k = int(hits[0])
        return row[:k].tolist(), True, k + 1
    return row.tolist(), False, int(row.size)


def generate_detailed(
    model: Transformer,
    params: Any,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    end_id: StopIds,
    pad_id: int,
    batch_size: int,
    overflow: Overflow = "error",
    matchers: Sequence[Any | None] | None = None,
    constraints: Any = None,
    prefix_cache: Any = None,
    on_token: Callable[[int, int], None] | None = None,
) -> Generation:
    """Like :func:`generate`, also saying which rows finished and how many tokens were made.

    ``matchers`` (one per prompt, None for a free row) constrains decoding (module doc); it needs
    ``constraints``, the ``needle.eval.constrain.Constraints`` that made them. ``prefix_cache``
    (a ``needle.serve.prefix_cache.PrefixCache`` of this model and params) supplies the keys and
    values of prompt prefixes it has seen, so only the rest of each prompt is prefilled, and
    keeps this call's prompts for later ones. ``on_token(i, id)`` is called as each token of
    prompt ``i`` is chosen (its stop id included), from a host loop: streaming (needle/serve/stream.py).
    """
    if matchers is not None and constraints is None:
        raise ValueError("matchers need the constraints that made them")
    if matchers is not None and len(matchers) != len(prompts):
        raise ValueError(f"matchers: {len(matchers)} given for {len(prompts)} prompts")
    if max_new_tokens < 1 or batch_size < 1:
        raise ValueError(f"max_new_tokens and batch_size must be positive, got {max_new_tokens}, {batch_size}")
    _check_prompts(model, prompts, max_new_tokens, overflow)
    params = decoding_params(model, params)  # once per call, not in every step of the loop
    stops = stop_array(end_id)
    max_len = model.cfg.max_len
    rows = min(batch_size, 1 << max(0, len(prompts) - 1).bit_length())
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    ids: list[list[int]] = [[] for _ in prompts]
    finished = [False] * len(prompts)
    n_tokens = n_steered = 0
    for start in range(0, len(order), rows):
        chunk = order[start : start + rows]
        bucket = bucket_for(max(len(prompts[i]) for i in chunk), max_len)
        cache = init_cache(model, rows, min(max_len, bucket + max_new_tokens))
        hits = [prefix_cache.match(prompts[i]) for i in chunk] if prefix_cache is not None else []
        starts = np.zeros((rows,), np.int32)
        if any(h.length for h in hits):  # else the plain prefill, exactly as without a cache
            starts[: len(hits)] = [h.length for h in hits]
            cache = prefix_cache.fill(cache, hits)  # batch-padding rows stay empty
        tokens = np.full((rows, bucket_for(max(len(prompts[i]) - starts[r] for r, i in enumerate(chunk)), max_len)),
                         pad_id, np.int32)  # fmt: skip
        lengths = np.ones((rows,), np.int32)
        limits = np.zeros((rows,), np.int32)
        for r, i in enumerate(chunk):
            tokens[r, : len(prompts[i]) - starts[r]] = prompts[i][starts[r] :]
            lengths[r] = len(prompts[i])
            limits[r] = min(max_new_tokens, max_len - len(prompts[i]))
        reused = starts if starts.any() else None
        row_matchers = [matchers[i] for i in chunk] + [None] * (rows - len(chunk)) if matchers else []
        if any(m is not None for m in row_matchers) or on_token is not None:
            emit = None if on_token is None else lambda r, t, chunk=chunk: on_token(chunk[r], t)
            out, steered, cache = _decode_host(model, params, cache, tokens, lengths, limits, stops, pad_id,
                                               max_new_tokens, row_matchers, constraints, reused, emit)  # fmt: skip
            n_steered += steered
        else:
            # stop/pad ids are traced, not static: one compiled program serves every tokenizer.
            out, cache = _decode_batch(
                model, params, cache, tokens, lengths, limits, stops, np.int32(pad_id), reused, max_new=max_new_tokens
            )
            out = np.asarray(out)
        if prefix_cache is not None:
            prefix_cache.store([prompts[i] for i in chunk], cache)
        for r, i in enumerate(chunk):
            ids[i], finished[i], made = _cut_at_end(out[r, : limits[r]], stops)
            n_tokens += made
    n_shrunk = sum(max_len - len(p) < max_new_tokens for p in prompts)
    return Generation(ids, finished, n_tokens, n_shrunk, n_steered)


def generate(
    model: Transformer, params: Any, prompts: list[list[int]], *, max_new_tokens: int, end_id: StopIds,
    pad_id: int, batch_size: int, overflow: Overflow = "error",
) -> list[list[int]]:  # fmt: skip
    """Greedy continuation of each prompt, up to and excluding the first stop id (module doc)."""
    options = dict(max_new_tokens=max_new_tokens, end_id=end_id, pad_id=pad_id, batch_size=batch_size)
    return generate_detailed(model, params, prompts, overflow=overflow, **options).ids


@partial(jax.jit, static_argnames="model")
def _forward(model: Transformer, params: Any, tokens: jax.Array) -> jax.Array:
    return model.apply({"params": params}, tokens)


def generate_uncached(
    model: Transformer, params: Any, prompts: list[list[int]], *, max_new_tokens: int, end_id: StopIds,
    pad_id: int, overflow: Overflow = "error",
) -> list[list[int]]:  # fmt: skip
    """Reference greedy decoding: one full causal forward pass over the whole prefix per token."""
    _check_prompts(model, prompts, max_new_tokens, overflow)
    stops = set(stop_array(end_id).tolist())
    max_len = model.cfg.max_len
    results = []
    for prompt in prompts:
        # Right padding never reaches earlier positions under causal attention.
        seq = np.full((1, max_len), pad_id, np.int32)
        seq[0, : len(prompt)] = prompt
        n, made = len(prompt), []
        for _ in range(min(max_new_tokens, max_len - n)):
            nxt = int(np.argmax(np.asarray(_forward(model, params, seq))[0, n - 1]))
            if nxt in stops:
                break
            made.append(nxt)
            seq[0, n] = nxt
            n += 1
        results.append(made)
    return results
