"""Fixed-shape, bucketed, seeded batches from a prepared split.

Each row becomes ``inputs = ids[:-1]``, ``targets = ids[1:]``, ``mask = loss_mask[1:]``,
padded to a bucket length ``T`` (16, 32, 64, 96, 128, 192, ...: powers of two and, from 64,
the 3/2 steps between them, capped at ``max_len``; ``max_len`` itself is the last bucket). A
batch holds rows of one bucket, so XLA compiles one program per bucket, not per length. A ragged batch is filled with all-padding rows (mask 0).

``batch(step)`` is a pure function of ``step``: epoch ``step // steps_per_epoch`` uses a
numpy Generator seeded by ``(seed, epoch)`` to permute rows and to order the batches, so a
resumed run sees exactly the batches it would have seen.

    plan = BatchPlan(data.splits["train"], batch_size=16, max_len=256, seed=0)
    b = plan.batch(0)   # {"inputs": int32[B,T], "targets": int32[B,T], "mask": float32[B,T]}
"""

from __future__ import annotations

from collections.abc import Iterator

import datasets
import numpy as np

MIN_BUCKET = 16

Batch = dict[str, np.ndarray]


def bucket_sizes(max_len: int) -> list[int]:
    """All bucket lengths for ``max_len``: 16, 32, 64, 96, 128, 192, 256, ... below it, then ``max_len``."""
    # From 64 up, a 3/2 step between powers of two: tool-calling rows (~150 tokens) would
    # otherwise pad to 256 and waste a third of every step; a few more compiled shapes are cheaper.
    sizes = []
    b = MIN_BUCKET
    while b < max_len:
        sizes.append(b)
        if b >= 64 and b * 3 // 2 < max_len:
            sizes.append(b * 3 // 2)
        b *= 2
    return sizes + [max_len]


def bucket_for(length: int, max_len: int) -> int:
    """Smallest bucket that holds ``length`` tokens."""
    if length > max_len:
        raise ValueError(f"length {length} exceeds max_len={max_len}")
    return next(b for b in bucket_sizes(max_len) if b >= length)


class BatchPlan:
    """Deterministic batches over one split (a ``datasets.Dataset`` with ``ids``/``loss_mask``)."""

    def __init__(self, split: datasets.Dataset, batch_size: int, max_len: int, seed: int, pad_id: int = 0) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        self.batch_size = batch_size
        self.max_len = max_len
        self.seed = seed
        self.pad_id = pad_id
        # Splits are small (thousands of rows): holding them as numpy arrays keeps batch() cheap.
        self._ids = [np.asarray(x, dtype=np.int32) for x in split["ids"]]
        self._mask = [np.asarray(x, dtype=np.float32) for x in split["loss_mask"]]
        for i, ids in enumerate(self._ids):
            if len(ids) > max_len:
                raise ValueError(f"row {i} has {len(ids)} tokens, more than max_len={max_len}")
        self._buckets = np.array([bucket_for(max(len(x) - 1, 1), max_len) for x in self._ids], dtype=np.int64)
        self._epoch_cache: tuple[int, list[tuple[int, np.ndarray]]] | None = None

    def __len__(self) -> int:
        return len(self._ids)

    @property
    def steps_per_epoch(self) -> int:
        """Batches in one pass; constant across epochs (bucket sizes do not depend on order)."""
        counts = np.unique(self._buckets, return_counts=True)[1]
        return int(sum(-(-c // self.batch_size) for c in counts))

    def _epoch_batches(self, epoch: int) -> list[tuple[int, np.ndarray]]:
        if self._epoch_cache is not None and self._epoch_cache[0] == epoch:
            return self._epoch_cache[1]
        rng = np.random.default_rng([self.seed, epoch])
        perm = rng.permutation(len(self._ids))
        batches: list[tuple[int, np.ndarray]] = []
        for bucket in bucket_sizes(self.max_len):
            members = perm[self._buckets[perm] == bucket]
            for start in range(0, len(members), self.batch_size):
                batches.append((bucket, members[start : start + self.batch_size]))
        order = rng.permutation(len(batches))
        result = [batches[i] for i in order]
        self._epoch_cache = (epoch, result)
        return result

    def _assemble(self, bucket: int, rows: np.ndarray) -> Batch:
        inputs = np.full((self.batch_size, bucket), self.pad_id, dtype=np.int32)
        targets = np.full((self.batch_size, bucket), self.pad_id, dtype=np.int32)
        mask = np.zeros((self.batch_size, bucket), dtype=np.float32)
        for r, i in enumerate(rows):
            ids, lm = self._ids[i], self._mask[i]
            n = len(ids) - 1
            inputs[r, :n] = ids[:-1]
            targets[r, :n] = ids[1:]
            mask[r, :n] = lm[1:]
        return {"inputs": inputs, "targets": targets, "mask": mask}

    def batch(self, step: int) -> Batch:
        """The training batch of global ``step`` (any step >= 0; epochs repeat reshuffled)."""
        spe = self.steps_per_epoch
        if spe == 0:
            raise ValueError("cannot draw batches from an empty split")
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        bucket, rows = self._epoch_batches(step // spe)[step % spe]
        return self._assemble(bucket, rows)

    def eval_batches(self) -> Iterator[Batch]:
        """Every row exactly once, in fixed-size bucketed batches, in a fixed order.

        Each batch also carries ``rows``: int32[B] split row indices, -1 for padding rows.
        """
        for bucket in bucket_sizes(self.max_len):
            members = np.flatnonzero(self._buckets == bucket)
            for start in range(0, len(members), self.batch_size):
                chunk = members[start : start + self.batch_size]
                out = self._assemble(bucket, chunk)
                rows = np.full(self.batch_size, -1, dtype=np.int32)
                rows[: len(chunk)] = chunk
                out["rows"] = rows
                yield out
