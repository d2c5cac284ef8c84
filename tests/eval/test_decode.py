"""Cached greedy decoding equals the uncached reference, and its edge cases."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from needle.config import model_preset
from needle.eval.decode import generate, generate_detailed, generate_uncached
from needle.model.decoder.transformer import Transformer

END, PAD, NEW = 2, 0, 8


@pytest.fixture(scope="module")
def tiny() -> tuple[Transformer, dict]:
    model = Transformer(model_preset("tiny", max_len=48))
    params = model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
    return model, params


def _prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(9, 512, size=n).tolist() for n in lengths]


def _both(model: Transformer, params: dict, prompts: list[list[int]], **kw: object) -> tuple[list, list]:
    kw = {"max_new_tokens": NEW, "end_id": END, "pad_id": PAD, **kw}
    return generate(model, params, prompts, batch_size=2, **kw), generate_uncached(model, params, prompts, **kw)


def test_cached_equals_uncached_on_ragged_batches(tiny: tuple[Transformer, dict]) -> None:
    model, params = tiny
    # 5 ragged prompts, batch 2: three batches of bucket 16, the last with a dead row.
    prompts = _prompts([3, 16, 9, 14, 1])
    cached, reference = _both(model, params, prompts)
    assert cached == reference
    assert all(len(ids) == NEW for ids in cached)  # a random model never says <|end|> here


def test_stops_at_end_token_and_excludes_it(tiny: tuple[Transformer, dict]) -> None:
    model, params = tiny
    prompts = _prompts([5, 12], seed=1)
    free = generate(model, params, prompts, max_new_tokens=NEW, end_id=END, pad_id=PAD, batch_size=2)
    # Declare the token row 0 emits third to be the end token: row 0 must stop before it.
    stop = free[0][2]
    out = generate_detailed(model, params, prompts, max_new_tokens=NEW, end_id=stop, pad_id=PAD, batch_size=2)
    assert out.ids[0] == free[0][: free[0].index(stop)]
    assert out.finished[0] is True
    assert out.n_tokens == len(out.ids[0]) + 1 + len(out.ids[1]) + out.finished[1]
    assert out.ids == _both(model, params, prompts, end_id=stop)[1]


def test_long_prompts_are_refused_or_given_a_smaller_budget(tiny: tuple[Transformer, dict]) -> None:
    model, params = tiny
    prompts = _prompts([44, 4])  # 44 > 48 - 8: only 4 tokens of room
    with pytest.raises(ValueError, match="prompt 0 has 44 tokens"):
        generate(model, params, prompts, max_new_tokens=NEW, end_id=END, pad_id=PAD, batch_size=2)
    out = generate_detailed(
        model, params, prompts, max_new_tokens=NEW, end_id=END, pad_id=PAD, batch_size=2, overflow="shrink"
    )
    assert [len(x) for x in out.ids] == [4, NEW] and out.n_shrunk == 1 and out.finished == [False, False]
    assert out.ids == _both(model, params, prompts, overflow="shrink")[1]
    with pytest.raises(ValueError, match="prompt 0 has 48 tokens"):
        generate_uncached(model, params, _prompts([48]), max_new_tokens=NEW, end_id=END, pad_id=PAD, overflow="shrink")


def test_empty_prompt_list_and_empty_prompt(tiny: tuple[Transformer, dict]) -> None:
    model, params = tiny
    assert generate(model, params, [], max_new_tokens=NEW, end_id=END, pad_id=PAD, batch_size=2) == []
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        generate(model, params, [[]], max_new_tokens=NEW, end_id=END, pad_id=PAD, batch_size=2)


def test_several_stop_ids_stop_each_row_at_the_first_one(tiny: tuple[Transformer, dict]) -> None:
    model, params = tiny
    prompts = _prompts([5, 12], seed=1)
    free = generate(model, params, prompts, max_new_tokens=NEW, end_id=END, pad_id=PAD, batch_size=2)
    stops = (free[0][2], free[1][4])  # e.g. Qwen's <|im_end|> and <|endoftext|>

    def cut(ids: list[int]) -> list[int]:
        hits = [i for i, t in enumerate(ids) if t in stops]
        return ids[: hits[0]] if hits else ids

    out = generate_detailed(model, params, prompts, max_new_tokens=NEW, end_id=stops, pad_id=PAD, batch_size=2)
    assert out.ids == [cut(free[0]), cut(free[1])] and out.finished == [True, True]
    assert out.ids == _both(model, params, prompts, end_id=list(stops))[1]
    # A single int and a one-element tuple are the same request.
    one = generate(model, params, prompts, max_new_tokens=NEW, end_id=(stops[0],), pad_id=PAD, batch_size=2)
    assert one == generate(model, params, prompts, max_new_tokens=NEW, end_id=stops[0], pad_id=PAD, batch_size=2)
    with pytest.raises(ValueError, match="at least one stop id"):
        generate(model, params, prompts, max_new_tokens=NEW, end_id=(), pad_id=PAD, batch_size=2)


def test_on_token_hears_each_token_as_chosen_and_changes_no_output(tiny: tuple[Transformer, dict]) -> None:
    """A streamed decode (``on_token``) runs the host loop, unmasked for free rows: the same ids
    as the single compiled loop, each token heard in order, its stop id included."""
    model, params = tiny
    prompts = _prompts([5, 12, 3], seed=1)
    free = generate(model, params, prompts, max_new_tokens=NEW, end_id=END, pad_id=PAD, batch_size=2)
    stop = free[0][2]  # row 0 stops at its third token, the others run to the budget
    kw = {"max_new_tokens": NEW, "end_id": stop, "pad_id": PAD, "batch_size": 2}
    whole = generate_detailed(model, params, prompts, **kw)
    heard: dict[int, list[int]] = {0: [], 1: [], 2: []}
    live = generate_detailed(model, params, prompts, on_token=lambda i, t: heard[i].append(t), **kw)
    assert live == whole and live.finished[0] and not live.finished[1]
    assert [heard[i] for i in range(3)] == [ids + [stop] * done for ids, done in zip(whole.ids, whole.finished)]


@pytest.mark.parametrize("new", [1, 2, NEW])
def test_streamed_decode_equals_the_compiled_loop_at_any_budget(tiny: tuple[Transformer, dict], new: int) -> None:
    """The host loop queues each step before it reads the last token back: budgets of one and two
    tokens, a prompt shrunk to a budget of one, and a batch whose rows all stop before the budget
    (one step queued past the end) give the compiled loop's ids, each token heard once."""
    model, params = tiny
    prompts = _prompts([5, 47, 3, 9], seed=2)
    free = generate(model, params, prompts, max_new_tokens=NEW, end_id=END, pad_id=PAD, batch_size=4,
                    overflow="shrink")  # fmt: skip
    stops = sorted({ids[1] for ids in free if len(ids) > 1} | {END})  # every row stops by its second token
    kw = {"max_new_tokens": new, "end_id": stops, "pad_id": PAD, "batch_size": 4, "overflow": "shrink"}
    whole = generate_detailed(model, params, prompts, **kw)
    heard: dict[int, list[int]] = {i: [] for i in range(4)}
    live = generate_detailed(model, params, prompts, on_token=lambda i, t: heard[i].append(t), **kw)
    assert live == whole and whole.n_shrunk == (new > 1) and len(whole.ids[1]) <= 1
    if new == NEW:
        assert all(len(ids) <= 1 for ids in whole.ids)  # all stopped early, before the budget
    assert all(len(heard[i]) == min(len(whole.ids[i]) + whole.finished[i], new) for i in range(4))
    assert [heard[i][: len(whole.ids[i])] for i in range(4)] == whole.ids
