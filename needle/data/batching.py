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

``PackedPlan`` packs several whole rows into each sequence of one fixed length ``T`` instead
(training's default): a batch also carries ``positions`` (RoPE positions, restarting at 0 for
every row) and ``segment_ids`` (1, 2, ... per row within a sequence, 0 for padding), so the
model attends within a row only and a packed row computes exactly what it would alone. One
shape per run means one compiled program, and padding shrinks to a few percent.

    plan = PackedPlan(data.splits["train"], batch_size=16, seq_len=320, seed=0)
    b = plan.batch(0)   # ... plus "positions": int32[B,T], "segment_ids": int32[B,T]
    plan.efficiency     # real tokens / slots of the first epoch's packing
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


# Rows packed together per best-fit-decreasing window: large enough to fill sequences tightly,
# small enough that each epoch's reshuffle changes which rows share a sequence and a batch.
PACK_WINDOW = 512


def pack_rows(lengths: np.ndarray, order: np.ndarray, seq_len: int, window: int = PACK_WINDOW) -> list[list[int]]:
    """Sequences (lists of row indices) holding every row of ``order`` once, none split.

    ``lengths[i]`` is the number of slots row ``i`` takes. Each window of ``window`` rows of
    ``order`` is packed best-fit decreasing (longest first, each into the fullest sequence it
    fits); ties keep ``order``, so the result is a pure function of the arguments.
    """
    sequences: list[list[int]] = []
    for start in range(0, len(order), window):
        chunk = order[start : start + window]
        chunk = chunk[np.argsort(-lengths[chunk], kind="stable")]
        free = np.empty(0, dtype=np.int64)
        bins: list[list[int]] = []
        for i in chunk:
            n = int(lengths[i])
            if n > seq_len:
                raise ValueError(f"row {int(i)} needs {n} slots, more than seq_len={seq_len}")
            fits = np.flatnonzero(free >= n)
            if len(fits):
                j = int(fits[np.argmin(free[fits])])
                bins[j].append(int(i))
                free[j] -= n
            else:
                bins.append([int(i)])
                free = np.append(free, seq_len - n)
        sequences.extend(bins)
    return sequences


def packing_efficiency(slots: np.ndarray, seq_len: int, seed: int = 0) -> float:
    """Real tokens / slots when rows taking ``slots[i]`` slots are packed into ``seq_len``."""
    order = np.random.default_rng(seed).permutation(len(slots))
    return float(slots.sum()) / (len(pack_rows(slots, order, seq_len)) * seq_len)


def choose_seq_len(
    slots: np.ndarray, lo: int, hi: int, attn_ratio: float, *, step: int = 16, sample: int = 2048, seed: int = 0
) -> int:
    """The packed sequence length in ``[lo, hi]`` (multiples of ``step``) of least compute per real token.

    A slot costs ``1 + T / attn_ratio`` (dense work plus attention over all ``T`` positions, with
    ``attn_ratio`` = a token's dense multiply-adds / its attention multiply-adds per position),
    and ``T`` is paid for at the packing efficiency of ``T``: rows of about ``T / 2`` tokens pack
    two to a sequence with little padding, so efficiency is far from monotonic in ``T``. Measured
    on up to ``sample`` rows (a fixed draw), so the choice is a pure function of the data.
    """
    if len(slots) == 0:
        return hi
    lo = max(lo, int(slots.max()))
    if lo >= hi:
        return lo
    if len(slots) > sample:
        slots = slots[np.random.default_rng(seed).choice(len(slots), sample, replace=False)]
    candidates = sorted({*range(-(-lo // step) * step, hi + 1, step), hi} - {0})
    if len(candidates) > 48:  # long contexts: an even spread of at most 48 lengths
        candidates = [candidates[int(i)] for i in np.linspace(0, len(candidates) - 1, 48)]
    cost = {t: (1 + t / attn_ratio) / packing_efficiency(slots, t, seed) for t in candidates if t >= lo}
    return min(cost, key=lambda t: (cost[t], t))


class PackedPlan:
    """Deterministic packed batches over one split: ``batch_size`` sequences of ``seq_len`` slots.

    Epoch ``e`` permutes the rows with a Generator seeded by ``(seed, e)``, packs them
    (:func:`pack_rows`) and shuffles the sequences; the training stream is epoch 0's sequences,
    then epoch 1's, ..., and ``batch(step)`` is sequences ``step*B .. step*B + B - 1`` of that
    stream: a pure function of ``step`` (a batch may straddle two epochs), so a resumed run sees
    exactly the batches it would have seen.
    """

    def __init__(self, split: datasets.Dataset, batch_size: int, seq_len: int, seed: int, pad_id: int = 0) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.max_len = seq_len  # what BatchPlan callers read
        self.seed = seed
        self.pad_id = pad_id
        self._ids = [np.asarray(x, dtype=np.int32) for x in split["ids"]]
        self._mask = [np.asarray(x, dtype=np.float32) for x in split["loss_mask"]]
        # A row of L tokens fills L - 1 slots (inputs ids[:-1], targets ids[1:]).
        self._slots = np.array([max(len(x) - 1, 1) for x in self._ids], dtype=np.int64)
        for i, n in enumerate(self._slots):
            if n > seq_len:
                raise ValueError(f"row {i} has {n + 1} tokens, more than seq_len + 1 = {seq_len + 1}")
        self._epoch_sizes: list[int] = []  # sequences in epochs 0, 1, ... (filled lazily)
        self._epoch_cache: dict[int, list[list[int]]] = {}

    def __len__(self) -> int:
        return len(self._ids)

    def _epoch(self, epoch: int) -> list[list[int]]:
        if epoch not in self._epoch_cache:
            rng = np.random.default_rng([self.seed, epoch])
            seqs = pack_rows(self._slots, rng.permutation(len(self._ids)), self.seq_len)
            order = rng.permutation(len(seqs))
            if len(self._epoch_cache) >= 2:  # a batch spans at most two epochs
                self._epoch_cache.pop(min(self._epoch_cache))
            self._epoch_cache[epoch] = [seqs[i] for i in order]
        return self._epoch_cache[epoch]

    def _epoch_size(self, epoch: int) -> int:
        while len(self._epoch_sizes) <= epoch:
            self._epoch_sizes.append(len(self._epoch(len(self._epoch_sizes))))
        return self._epoch_sizes[epoch]

    @property
    def steps_per_epoch(self) -> int:
        """Batches in the first epoch (later epochs pack within a sequence or two of it)."""
        return -(-self._epoch_size(0) // self.batch_size) if self._ids else 0

    @property
    def efficiency(self) -> float:
        """Real tokens / slots of the first epoch's sequences (padding of the last batch aside)."""
        if not self._ids:
            return 0.0
        return float(self._slots.sum()) / (self._epoch_size(0) * self.seq_len)

    def _sequences(self, start: int, count: int) -> list[list[int]]:
        """Sequences ``start .. start + count - 1`` of the training stream."""
        out: list[list[int]] = []
        epoch, offset = 0, start
        while offset >= self._epoch_size(epoch):
            offset -= self._epoch_size(epoch)
            epoch += 1
        while len(out) < count:
            seqs = self._epoch(epoch)
            out.extend(seqs[offset : offset + count - len(out)])
            epoch, offset = epoch + 1, 0
        return out

    def _assemble(self, sequences: list[list[int]]) -> Batch:
        shape = (self.batch_size, self.seq_len)
        inputs = np.full(shape, self.pad_id, dtype=np.int32)
        targets = np.full(shape, self.pad_id, dtype=np.int32)
        mask = np.zeros(shape, dtype=np.float32)
        positions = np.zeros(shape, dtype=np.int32)
        segments = np.zeros(shape, dtype=np.int32)
        for r, rows in enumerate(sequences):
            at = 0
            for seg, i in enumerate(rows, start=1):
                ids, lm = self._ids[i], self._mask[i]
                n = len(ids) - 1
                inputs[r, at : at + n] = ids[:-1]
                targets[r, at : at + n] = ids[1:]
                mask[r, at : at + n] = lm[1:]
                positions[r, at : at + n] = np.arange(n, dtype=np.int32)
                segments[r, at : at + n] = seg
                at += n
        return {"inputs": inputs, "targets": targets, "mask": mask, "positions": positions, "segment_ids": segments}

    def batch(self, step: int) -> Batch:
        """The training batch of global ``step`` (any step >= 0)."""
        if not self._ids:
            raise ValueError("cannot draw batches from an empty split")
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        return self._assemble(self._sequences(step * self.batch_size, self.batch_size))

    def eval_batches(self) -> Iterator[Batch]:
        """Every row exactly once, packed in a fixed order, in batches of the training shape
        (a last, partial batch is filled with empty sequences: segment 0, mask 0)."""
        seqs = pack_rows(self._slots, np.arange(len(self._ids)), self.seq_len, window=max(len(self._ids), 1))
        for start in range(0, len(seqs), self.batch_size):
            chunk = seqs[start : start + self.batch_size]
            yield self._assemble(chunk)
