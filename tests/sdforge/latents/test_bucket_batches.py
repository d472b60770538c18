"""Batches by bucket: one shape per batch, the same plan on every rank, disjoint rank slices, exact resume,
tails dropped or carried (issue 18's loader order)."""

from __future__ import annotations

import numpy as np
import pytest

from sdforge.latents.bucket_batches import BatchSplit, plan_epoch

WORLD, BATCH = 2, 4
GLOBAL = WORLD * BATCH
SPLIT = BatchSplit(BATCH, 1, WORLD)


def _buckets(n: int = 203, seed: int = 0) -> np.ndarray:
    """A bucket id per sample: 5 buckets of uneven sizes."""
    return np.random.default_rng(seed).choice(5, size=n, p=[0.4, 0.25, 0.2, 0.1, 0.05])


@pytest.mark.parametrize("tail", ["drop", "carry"])
def test_no_batch_mixes_buckets_and_ranks_are_disjoint_over_a_whole_epoch(tail):
    ids = _buckets()
    for epoch in range(3):
        plan = plan_epoch(ids, epoch, 7, GLOBAL, tail=tail)
        seen = []
        for b, bucket in enumerate(plan.buckets):
            ranks = [plan.batches[b][SPLIT.part(0, r)] for r in range(WORLD)]
            assert all(len(x) == BATCH for x in ranks)
            assert {int(ids[i]) for x in ranks for i in x} == {bucket}  # one shape per global batch
            assert not set(ranks[0]) & set(ranks[1])
            seen += [int(i) for x in ranks for i in x]
        left = [int(i) for t in plan.left_out.values() for i in t]
        assert len(seen) == len(set(seen))  # each sample at most once per epoch
        assert sorted(seen + left) == list(range(len(ids)))  # and every sample trained or left out
        assert all(len(t) < GLOBAL for t in plan.left_out.values())


def test_every_rank_computes_the_same_plan_and_resume_at_k_continues_exactly():
    ids = _buckets()
    a = plan_epoch(ids, 2, 7, GLOBAL)
    b = plan_epoch(ids.copy(), 2, 7, GLOBAL)  # another rank, another process
    assert a.buckets == b.buckets and all((x == y).all() for x, y in zip(a.batches, b.batches, strict=True))
    k = 9
    for rank in range(WORLD):
        full = [x.tolist() for x in a.micro_batches(rank, SPLIT)]
        resumed = [b.batches[i][SPLIT.part(0, rank)].tolist() for i in range(k, len(b.batches))]
        assert resumed == full[k:]
    other = plan_epoch(ids, 3, 7, GLOBAL)
    assert [x.tolist() for x in other.batches] != [x.tolist() for x in a.batches]  # epochs differ


def test_drop_counts_and_carry_brings_the_left_out_samples_first_next_epoch():
    ids = _buckets()
    sizes = np.bincount(ids, minlength=5)
    dropped = plan_epoch(ids, 0, 1, GLOBAL, tail="drop")
    counts = dropped.counts()
    for bucket, n in enumerate(sizes):
        assert counts[f"samples.bucket{bucket}"] == n // GLOBAL * GLOBAL
        assert counts[f"left_out.bucket{bucket}"] == n % GLOBAL
    first = plan_epoch(ids, 0, 1, GLOBAL, tail="carry")
    second = plan_epoch(ids, 1, 1, GLOBAL, tail="carry")
    for bucket, tail in first.left_out.items():
        if not tail.size:
            continue
        batches = [x for x, bb in zip(second.batches, second.buckets, strict=True) if bb == bucket]
        trained = {int(i) for x in batches for i in x}
        assert set(tail.tolist()) <= trained  # no sample is left out two epochs in a row
        assert not set(tail.tolist()) & set(second.left_out[bucket].tolist())


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="tail"):
        plan_epoch(np.zeros(4, int), 0, 0, 2, tail="keep")
    with pytest.raises(ValueError, match="bucket ids"):
        plan_epoch(np.array([0.5, 1.0]), 0, 0, 2)
    with pytest.raises(ValueError, match="global_batch"):
        plan_epoch(np.zeros(4, int), 0, 0, 0)


@pytest.mark.parametrize("world,micro", [(1, 8), (2, 4), (4, 2), (2, 2), (4, 1)])
def test_the_samples_of_every_step_do_not_depend_on_the_world_size(world, micro):
    """Elastic resume's premise: the plan is one of global batches; any split of them (ranks × accumulation ×
    micro-batch) trains each step's samples exactly once."""
    ids = _buckets()
    plan = plan_epoch(ids, 1, 7, GLOBAL, tail="carry")
    split = BatchSplit(micro, GLOBAL // (micro * world), world)
    assert split.global_batch == GLOBAL
    per_rank = [plan.micro_batches(r, split) for r in range(world)]
    for step, batch in enumerate(plan.batches):
        parts = [per_rank[r][step * split.accum + k] for r in range(world) for k in range(split.accum)]
        assert sorted(np.concatenate(parts).tolist()) == sorted(batch.tolist())
