"""Prefix reuse in serving (needle/serve/prefix_cache.py): prompts that share a prefix decode the
same with the cache as without it, the cache finds whole shared blocks only, stays within its bytes
by evicting leaves before their parents, and works on Needle 3's scanned cache layout too."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import traverse_util
from safetensors import safe_open
from safetensors.numpy import load_file

from needle.eval.decode import generate_detailed
from needle.model.factory import module_for
from needle.model.io import load_model
from needle.serve.engine import PREFIX_CACHE_ENV, Predictor, prefix_cache_mb_from_env
from needle.serve.prefix_cache import PrefixCache, cache_axes
from needle.model.decoder.transformer import init_cache
from needle.serve.prompt import Request

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "needle3"
WEATHER = {"name": "get_weather", "description": "Current weather for a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}  # fmt: skip
TIP = {"name": "get_tip", "description": "Tip on a bill",
       "parameters": {"type": "object", "properties": {"amount": {"type": "number"}, "percent": {"type": "integer"}},
                      "required": ["amount", "percent"]}}  # fmt: skip
TOOLS = [WEATHER, TIP]


def _prompts(seed: int, shared: int, tails: tuple[int, ...], vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    base = rng.integers(4, vocab, shared).tolist()
    return [base + rng.integers(4, vocab, k).tolist() for k in tails] + [base[: shared - 5]]


def _decode(model, params, prompts: list[list[int]], cache: PrefixCache | None, **kw) -> list[list[int]]:
    options = dict(max_new_tokens=12, end_id=[1], pad_id=0, batch_size=4, overflow="shrink")
    return generate_detailed(model, params, prompts, prefix_cache=cache, **{**options, **kw}).ids


def test_shared_prefixes_decode_as_without_the_cache(tiny_model_dir: Path) -> None:
    loaded = load_model(tiny_model_dir)
    model = module_for(loaded.model_cfg)
    prompts = _prompts(0, 70, (3, 17, 40), model.cfg.vocab_size)
    want = _decode(model, loaded.params, prompts, None)
    cache = PrefixCache(model, 1 << 20)
    assert _decode(model, loaded.params, prompts, cache) == want  # first sight: stored, nothing reused
    assert cache.stats()["hit_tokens"] == 0 and cache.stats()["blocks"] > 0
    assert _decode(model, loaded.params, prompts, cache) == want  # now each prefills only its tail
    # Each reuses its whole blocks short of its last token: 73, 87, 110 and 65 tokens long.
    assert cache.stats()["hit_tokens"] == 64 + 80 + 96 + 64
    longer = [p + [7, 8, 9] for p in prompts]  # the next turn of each: a longer prompt, some rows missing
    assert _decode(model, loaded.params, longer + [[5] * 30], cache) == _decode(model, loaded.params, longer + [[5] * 30], None)


def test_match_keeps_a_token_to_prefill_and_needs_the_whole_prefix(tiny_model_dir: Path) -> None:
    model = module_for(load_model(tiny_model_dir).model_cfg)
    cache = PrefixCache(model, 1 << 20, block=16)
    prompt = list(range(4, 36))  # two whole blocks
    cache.store([prompt], jax.tree.map(lambda x: x + 1, init_cache(model, 1, 64)))
    assert cache.stats()["blocks"] == 2
    assert cache.match(prompt).length == 16  # 32 would leave no token whose logits start the answer
    assert cache.match(prompt + [9]).length == 32
    assert cache.match([99] + prompt[1:] + [9]).length == 0  # block 2 alone is not this prompt's prefix


def test_the_cache_stays_within_its_bytes_and_evicts_leaves_first(tiny_model_dir: Path) -> None:
    loaded = load_model(tiny_model_dir)
    model = module_for(loaded.model_cfg)
    probe = PrefixCache(model, 1 << 20)
    _decode(model, loaded.params, [list(range(4, 4 + 49))], probe)
    per_block = probe.stats()["bytes"] // probe.stats()["blocks"]
    assert probe.stats()["blocks"] == 3
    cache = PrefixCache(model, 2 * per_block)  # room for two of the prompt's three blocks
    prompt = list(range(4, 4 + 49))
    _decode(model, loaded.params, [prompt], cache)
    stats = cache.stats()
    assert stats["blocks"] == 2 and stats["bytes"] <= 2 * per_block and stats["evicted_blocks"] == 1
    assert cache.match(prompt).length == 32  # the third block went; the prefix it extended stayed
    # A new prompt pushes the old one out, least recently used first; the bound holds throughout.
    other = list(range(500, 500 + 40))
    assert _decode(model, loaded.params, [other], cache) == _decode(model, loaded.params, [other], None)
    assert cache.stats()["bytes"] <= 2 * per_block and cache.match(other + [1]).length == 32
    assert cache.match(prompt).length == 0


def test_predictor_conversations_turn_by_turn_match_no_cache(tiny_model_dir: Path, monkeypatch) -> None:
    """The served path: a conversation that grows by a turn per request, free and constrained."""
    loaded = load_model(tiny_model_dir)
    cached, plain = Predictor(loaded), Predictor(loaded, prefix_cache_mb=0)
    assert cached.prefix_cache is not None and plain.prefix_cache is None
    messages: list[dict] = [{"role": "system", "content": "You are a helpful assistant for a restaurant app."},
                            {"role": "user", "content": "What is a 15 percent tip on 80?"}]  # fmt: skip
    for turn in range(3):
        for constrained in (True, False):
            requests = [Request(messages=list(messages), tools=TOOLS, mode="auto")]
            assert cached.predict(requests, constrained=constrained) == plain.predict(requests, constrained=constrained)
        call = {"id": f"call_{turn}", "type": "function",
                "function": {"name": "get_tip", "arguments": json.dumps({"amount": 80 + turn, "percent": 15})}}  # fmt: skip
        messages += [{"role": "assistant", "content": None, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": f"call_{turn}", "content": json.dumps({"tip": 12.0})},
                     {"role": "assistant", "content": "It is 12."}, {"role": "user", "content": "And now?"}]  # fmt: skip
    assert cached.prefix_cache.stats()["hit_tokens"] > 0
    monkeypatch.setenv(PREFIX_CACHE_ENV, "0.5")
    assert prefix_cache_mb_from_env() == 0.5 and Predictor(loaded).prefix_cache.max_bytes == 2**19
    monkeypatch.setenv(PREFIX_CACHE_ENV, "lots")
    with pytest.raises(ValueError, match="NEEDLE_PREFIX_CACHE_MB='lots' is not a number"):
        Predictor(loaded)


def test_needle3_scanned_cache_reuses_prefixes_too() -> None:
    path = FIXTURES / "plain.safetensors"
    with safe_open(str(path), framework="np") as f:
        config = json.loads(f.metadata()["config"])
    params = traverse_util.unflatten_dict({tuple(k.split("/")): v for k, v in load_file(str(path)).items()})
    from needle.model.needle3.checkpoint import needle3_model_config

    model = module_for(needle3_model_config(config))
    axes = cache_axes(model)
    assert (1, 2) in axes and (0, 1) in axes  # scanned layers lead; the token history is [B, S]
    prompts = _prompts(1, 40, (2, 9), model.cfg.vocab_size)
    want = _decode(model, params, prompts, None, max_new_tokens=6)
    cache = PrefixCache(model, 1 << 20)
    for _ in range(2):
        assert _decode(model, params, prompts, cache, max_new_tokens=6) == want
    assert cache.stats()["hit_tokens"] > 0
