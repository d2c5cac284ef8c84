"""BatchPlan: bucketed fixed shapes, shift and mask, step-pure shuffling, full eval coverage."""

from __future__ import annotations

import datasets
import numpy as np
import pytest

from needle.data.batching import BatchPlan, bucket_for, bucket_sizes

PAD = 0


def _split(lengths: list[int]) -> datasets.Dataset:
    # Row i's tokens all carry the id 1000 + i, so any batch row says which row it came from.
    rows = [{"ids": [1000 + i] * n, "loss_mask": [0] * (n // 2) + [1] * (n - n // 2)} for i, n in enumerate(lengths)]
    return datasets.Dataset.from_list(rows)


LENGTHS = [5, 17, 30, 33, 64, 65, 100, 128, 3, 12, 40, 90, 77, 20, 16, 9, 120, 60, 31]


def _row_ids(batch: dict[str, np.ndarray]) -> list[int]:
    return [int(r[0]) - 1000 for r in batch["inputs"] if r[0] != PAD]


def test_buckets() -> None:
    assert bucket_sizes(256) == [16, 32, 64, 96, 128, 192, 256]
    assert bucket_sizes(200) == [16, 32, 64, 96, 128, 192, 200]
    assert bucket_sizes(96) == [16, 32, 64, 96]
    assert [bucket_for(n, 200) for n in (1, 16, 17, 65, 129, 193, 200)] == [16, 16, 32, 96, 192, 200, 200]
    with pytest.raises(ValueError, match="exceeds max_len"):
        bucket_for(201, 200)


def test_batches_have_fixed_shapes_and_shifted_targets() -> None:
    plan = BatchPlan(_split(LENGTHS), batch_size=4, max_len=128, seed=0, pad_id=PAD)
    assert plan.steps_per_epoch == 6  # buckets 16:6 rows, 32:4, 64:4, 96:2, 128:3 -> 2+1+1+1+1
    for step in range(plan.steps_per_epoch):
        b = plan.batch(step)
        B, T = b["inputs"].shape
        assert B == 4 and T in bucket_sizes(128)
        assert b["inputs"].dtype == np.int32 and b["targets"].dtype == np.int32 and b["mask"].dtype == np.float32
        for r, i in enumerate(_row_ids(b)):
            n = LENGTHS[i] - 1
            assert bucket_for(n, 128) == T
            assert (b["inputs"][r, :n] == 1000 + i).all() and (b["inputs"][r, n:] == PAD).all()
            assert (b["targets"][r, :n] == 1000 + i).all()
            assert b["mask"][r].tolist() == ([0.0] * (LENGTHS[i] // 2) + [1.0] * (LENGTHS[i] - LENGTHS[i] // 2))[1:] + [0.0] * (T - n)


def test_ragged_batches_are_padded_with_masked_rows() -> None:
    plan = BatchPlan(_split([10, 11, 12]), batch_size=8, max_len=64, seed=0)
    b = plan.batch(0)
    assert b["inputs"].shape == (8, 16)
    assert b["mask"][3:].sum() == 0 and (b["inputs"][3:] == PAD).all()


def test_batch_is_a_pure_function_of_step() -> None:
    a = BatchPlan(_split(LENGTHS), batch_size=4, max_len=128, seed=7)
    b = BatchPlan(_split(LENGTHS), batch_size=4, max_len=128, seed=7)
    for step in [13, 0, 5, 13, 2]:  # out of order, across epochs, repeated
        x, y = a.batch(step), b.batch(step)
        assert all(np.array_equal(x[k], y[k]) for k in ("inputs", "targets", "mask"))


def test_each_epoch_sees_every_row_once_in_a_new_order() -> None:
    plan = BatchPlan(_split(LENGTHS), batch_size=4, max_len=128, seed=1)
    spe = plan.steps_per_epoch
    orders = []
    for epoch in range(3):
        seen = [i for s in range(epoch * spe, (epoch + 1) * spe) for i in _row_ids(plan.batch(s))]
        assert sorted(seen) == list(range(len(LENGTHS)))
        orders.append(seen)
    assert orders[0] != orders[1] != orders[2]
    other_seed = BatchPlan(_split(LENGTHS), batch_size=4, max_len=128, seed=2)
    assert [i for s in range(spe) for i in _row_ids(other_seed.batch(s))] != orders[0]


def test_eval_batches_cover_each_row_once() -> None:
    plan = BatchPlan(_split(LENGTHS), batch_size=4, max_len=128, seed=0)
    batches = list(plan.eval_batches())
    rows = [int(i) for b in batches for i in b["rows"] if i >= 0]
    assert sorted(rows) == list(range(len(LENGTHS)))
    for b in batches:
        assert b["inputs"].shape[0] == 4 and b["rows"].shape == (4,)
        assert [int(i) for i in b["rows"] if i >= 0] == _row_ids(b)
        assert b["mask"][b["rows"] < 0].sum() == 0
    assert [b["rows"].tolist() for b in plan.eval_batches()] == [b["rows"].tolist() for b in batches]


def test_empty_split_and_overlong_rows_are_errors() -> None:
    plan = BatchPlan(datasets.Dataset.from_dict({"ids": [], "loss_mask": []}), batch_size=2, max_len=64, seed=0)
    assert plan.steps_per_epoch == 0 and list(plan.eval_batches()) == []
    with pytest.raises(ValueError, match="empty split"):
        plan.batch(0)
    with pytest.raises(ValueError, match="more than max_len=64"):
        BatchPlan(_split([65]), batch_size=2, max_len=64, seed=0)


# --- PackedPlan -------------------------------------------------------------------------------

from needle.data.batching import PackedPlan, pack_rows  # noqa: E402


def _rows_of(batch: dict[str, np.ndarray]) -> list[list[int]]:
    """Row indices of each sequence, read from the segment runs."""
    out = []
    for inp, seg in zip(batch["inputs"], batch["segment_ids"]):
        out.append([int(inp[np.flatnonzero(seg == s)[0]]) - 1000 for s in range(1, int(seg.max()) + 1)])
    return out


def test_pack_rows_keeps_rows_whole_and_fits() -> None:
    lengths = np.array([n - 1 for n in LENGTHS])
    seqs = pack_rows(lengths, np.arange(len(LENGTHS)), 128)
    assert sorted(i for s in seqs for i in s) == list(range(len(LENGTHS)))
    assert all(sum(lengths[i] for i in s) <= 128 for s in seqs)
    assert len(seqs) == -(-int(lengths.sum()) // 128)  # as few sequences as the tokens allow here
    with pytest.raises(ValueError, match="seq_len"):
        pack_rows(np.array([129]), np.arange(1), 128)


def test_packed_batch_layout_positions_segments_and_mask() -> None:
    plan = PackedPlan(_split(LENGTHS), batch_size=2, seq_len=128, seed=0, pad_id=PAD)
    b = plan.batch(0)
    assert set(b) == {"inputs", "targets", "mask", "positions", "segment_ids"}
    assert all(v.shape == (2, 128) for v in b.values())
    for r in range(2):
        seg, pos = b["segment_ids"][r], b["positions"][r]
        for s in range(1, int(seg.max()) + 1):
            idx = np.flatnonzero(seg == s)
            row = int(b["inputs"][r, idx[0]]) - 1000
            n = LENGTHS[row] - 1
            assert len(idx) == n and np.array_equal(idx, np.arange(idx[0], idx[0] + n))  # contiguous, whole
            assert pos[idx].tolist() == list(range(n))  # RoPE positions restart per row
            assert np.all(b["inputs"][r, idx] == 1000 + row) and np.all(b["targets"][r, idx] == 1000 + row)
            mask = [0] * (LENGTHS[row] // 2) + [1] * (LENGTHS[row] - LENGTHS[row] // 2)
            assert b["mask"][r, idx].tolist() == mask[1:]
        pad = seg == 0
        assert np.all(b["mask"][r, pad] == 0) and np.all(b["inputs"][r, pad] == PAD)


def test_packed_batches_are_step_pure_cover_each_epoch_and_reshuffle() -> None:
    a = PackedPlan(_split(LENGTHS), batch_size=2, seq_len=128, seed=5)
    b = PackedPlan(_split(LENGTHS), batch_size=2, seq_len=128, seed=5)
    # A fresh plan asked for a late step first (a resume) gives the same batch.
    late = b.batch(9)
    firsts = [a.batch(s) for s in range(10)]
    assert all(np.array_equal(late[k], firsts[9][k]) for k in late)
    # The stream's first epoch holds every row exactly once.
    n_seq = a._epoch_size(0)
    rows = [r for s in range(-(-n_seq // 2)) for r in _rows_of(a.batch(s))][:n_seq]
    stream = [i for seq in rows for i in seq]
    assert sorted(stream) == list(range(len(LENGTHS)))
    assert a._epoch(0) != a._epoch(1)  # each epoch repacks and reshuffles
    assert 0.8 < a.efficiency <= 1.0


def test_packed_eval_batches_cover_each_row_once_in_the_training_shape() -> None:
    plan = PackedPlan(_split(LENGTHS), batch_size=4, seq_len=128, seed=0)
    batches = list(plan.eval_batches())
    assert all(b["inputs"].shape == (4, 128) for b in batches)
    rows = [i for b in batches for seq in _rows_of(b) for i in seq]
    assert sorted(rows) == list(range(len(LENGTHS)))
    assert sum(float(b["mask"].sum()) for b in batches) == sum(n - n // 2 - (n // 2 == 0) for n in LENGTHS)


def test_packed_plan_refuses_a_row_longer_than_the_sequence() -> None:
    with pytest.raises(ValueError, match="more than seq_len"):
        PackedPlan(_split([130]), batch_size=2, seq_len=128, seed=0)
