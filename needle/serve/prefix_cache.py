"""Automatic prefix caching: keys and values of prompt prefixes already seen, reused by later prompts.

An app sends the same system turn and tool block with every request, and each turn of a
conversation resends the turns before it. ``PrefixCache`` keeps the KV cache of those prefixes in
blocks of ``block`` tokens (vLLM's automatic prefix caching): block ``i`` of a prompt is keyed by a
hash of tokens ``0 .. (i + 1) * block``, chained through the previous block's key, so a block is
found only after the same whole prefix. ``needle.eval.decode.generate_detailed`` asks
:meth:`match` for each prompt's longest cached prefix (always leaving at least one token to
prefill, whose logits start the answer), writes it into the new cache with :meth:`fill`, prefills
only the rest at their own positions, and after decoding hands the cache to :meth:`store`.

Memory is bounded: blocks live in host memory, at most ``max_bytes`` of them, least recently used
evicted first. A lookup touches a chain from its last block back to its first, so a parent is
always more recent than its children and eviction takes leaves before the prefixes they extend.

The cache belongs to one model and its weights; the caller makes a new one when either changes.
Keys and values depend only on the prefix (causal attention, RoPE at absolute positions), so a
reused prefix gives the logits decoding without the cache gives, to float rounding.

    cache = PrefixCache(model, max_bytes=256 << 20)
    generate_detailed(model, params, prompts, ..., prefix_cache=cache)
    cache.stats()   # {"blocks": ..., "bytes": ..., "hit_tokens": ..., "prompt_tokens": ..., ...}
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from needle.model.decoder.transformer import init_cache


@dataclass
class Hit:
    """A prompt's longest cached prefix: its length in tokens and its blocks, first to last."""

    length: int = 0
    blocks: list[list[np.ndarray]] = field(default_factory=list)


def cache_axes(model: Any) -> list[tuple[int, int]]:
    """(batch axis, slot axis) of each leaf of ``model``'s KV cache, in tree-flatten order.

    Found from the cache's shapes at two sizes, so any layout works: Transformer's ``[B, S, ...]``
    leaves, Needle 3's scanned ``[layers, B, S, ...]`` ones and its ``[B, S]`` token history."""
    small = jax.tree.leaves(jax.eval_shape(lambda: init_cache(model, 3, 7)))
    large = jax.tree.leaves(jax.eval_shape(lambda: init_cache(model, 5, 11)))
    axes = []
    for a, b in zip(small, large):
        changed = {(x, y): i for i, (x, y) in enumerate(zip(a.shape, b.shape)) if x != y}
        if set(changed) != {(3, 5), (7, 11)}:
            raise ValueError(f"cannot tell the batch and slot axes of a cache leaf shaped {a.shape}")
        axes.append((changed[(3, 5)], changed[(7, 11)]))
    return axes


def _canonical(leaf: Any, axes: tuple[int, int]) -> np.ndarray:
    """A host view of ``leaf`` with the batch and slot axes first: ``[B, S, ...]``."""
    return np.moveaxis(np.asarray(leaf), axes, (0, 1))


class PrefixCache:
    """Blocks of prompt-prefix keys and values, LRU-evicted beyond ``max_bytes`` (module doc)."""

    def __init__(self, model: Any, max_bytes: int, block: int = 16) -> None:
        if max_bytes < 0 or block < 1:
            raise ValueError(f"PrefixCache needs max_bytes >= 0 and block >= 1, got {max_bytes}, {block}")
        self.max_bytes, self.block = max_bytes, block
        self._axes = cache_axes(model)
        self._blocks: OrderedDict[bytes, list[np.ndarray]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._counts = {"prompts": 0, "prompt_tokens": 0, "hit_tokens": 0, "evicted_blocks": 0}

    def _keys(self, prompt: list[int], n_blocks: int) -> list[bytes]:
        keys, key = [], b""
        tokens = np.asarray(prompt, np.int32)
        for i in range(n_blocks):
            key = hashlib.blake2b(key + tokens[i * self.block : (i + 1) * self.block].tobytes(), digest_size=16).digest()
            keys.append(key)
        return keys

    def match(self, prompt: list[int]) -> Hit:
        """The longest cached prefix of ``prompt`` that leaves at least its last token to prefill."""
        keys = self._keys(prompt, (len(prompt) - 1) // self.block)
        with self._lock:
            found = []
            for key in keys:
                if key not in self._blocks:
                    break
                found.append(key)
            for key in reversed(found):  # children first: parents end up the more recent
                self._blocks.move_to_end(key)
            self._counts["prompts"] += 1
            self._counts["prompt_tokens"] += len(prompt)
            self._counts["hit_tokens"] += len(found) * self.block
            return Hit(len(found) * self.block, [self._blocks[k] for k in found])

    def fill(self, cache: Any, hits: list[Hit]) -> Any:
        """``cache`` (a zero cache, one row per hit) with each row's cached prefix in its first slots."""
        leaves, tree = jax.tree.flatten(cache)
        out = []
        for j, (leaf, axes) in enumerate(zip(leaves, self._axes)):
            host = np.zeros(np.moveaxis(np.empty(leaf.shape, np.bool_), axes, (0, 1)).shape, leaf.dtype)
            for r, hit in enumerate(hits):
                if hit.length:
                    host[r, : hit.length] = np.concatenate([blocks[j] for blocks in hit.blocks])
            out.append(jax.numpy.asarray(np.moveaxis(host, (0, 1), axes)))
        return jax.tree.unflatten(tree, out)

    def store(self, prompts: list[list[int]], cache: Any) -> None:
        """Keep the whole blocks of each row's prompt (row ``r`` of ``cache`` holds ``prompts[r]``)."""
        if self.max_bytes == 0:
            return
        leaves = None
        for r, prompt in enumerate(prompts):
            keys = self._keys(prompt, len(prompt) // self.block)
            with self._lock:
                missing = [i for i, k in enumerate(keys) if k not in self._blocks]
            if not missing:
                continue
            if leaves is None:  # one device-to-host copy per leaf, only when something is new
                leaves = [_canonical(leaf, axes) for leaf, axes in zip(jax.tree.leaves(cache), self._axes)]
            with self._lock:
                for i in missing:
                    span = slice(i * self.block, (i + 1) * self.block)
                    blocks = [np.array(leaf[r, span]) for leaf in leaves]
                    self._blocks[keys[i]] = blocks
                    self._bytes += sum(b.nbytes for b in blocks)
                for key in reversed(keys):
                    self._blocks.move_to_end(key)
                while self._bytes > self.max_bytes and self._blocks:
                    _, blocks = self._blocks.popitem(last=False)
                    self._bytes -= sum(b.nbytes for b in blocks)
                    self._counts["evicted_blocks"] += 1

    def stats(self) -> dict[str, int]:
        """Blocks and bytes held, prompts and their tokens looked up, tokens found cached, evictions."""
        with self._lock:
            return {"blocks": len(self._blocks), "bytes": self._bytes, **self._counts}
