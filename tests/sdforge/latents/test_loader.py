"""Latent loader: gathers the indexed rows from memmapped shards, validates the index, disjoint ranks, exact resume."""

import numpy as np
import polars as pl
import pytest
import torch
from safetensors.torch import load_file

from sdforge.io import InputError
from sdforge.latents.bucket_batches import BatchSplit
from sdforge.latents.loader import LatentIndexDataset, epochs_summary, iter_batches, rank_batches
from sdforge.latents.store import shard_path, write_shard

ROWS = 10  # per shard
RES = "sq"  # the resolution folder of the square-only store
SQ = (4, 4)  # its one bucket: 4×4 px → latents [4, 2, 2]


def _shard_values(source: str, shard: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Latents whose every element names (source, shard, row, element); ids likewise."""
    base = (0 if source == "a" else 1000) + shard * 100
    rows = torch.arange(base, base + ROWS, dtype=torch.float32).view(ROWS, 1, 1, 1)
    lat = rows + torch.arange(16, dtype=torch.float32).view(1, 4, 2, 2) / 16  # exact in fp16
    ids = torch.arange(base, base + ROWS, dtype=torch.int32).view(ROWS, 1) * 100 + torch.arange(77, dtype=torch.int32)
    return lat, ids


@pytest.fixture
def store(tmp_path):
    for source in ("a", "b"):
        for shard in range(2):
            write_shard(shard_path(tmp_path, source, RES, shard, SQ), *_shard_values(source, shard))
    rng = np.random.default_rng(0)
    n = 41
    index = pl.DataFrame(
        {
            "source": rng.choice(["a", "b"], n).tolist(),
            "shard": rng.integers(0, 2, n).tolist(),
            "bucket_width": [SQ[0]] * n,
            "bucket_height": [SQ[1]] * n,
            "row": rng.integers(0, ROWS, n).tolist(),  # repeats allowed (with-replacement mixes)
            "key": ["k"] * n,
        }
    )
    index.write_parquet(tmp_path / "idx.parquet")
    return tmp_path


def _expected(store, positions):
    """The indexed rows, read independently with safetensors' own loader."""
    index = pl.read_parquet(store / "idx.parquet")
    lat, ids = [], []
    for p in positions:
        source, shard, bw, bh, row = index.row(int(p))[:5]
        tensors = load_file(shard_path(store, source, RES, shard, (bw, bh)))
        lat.append(tensors["latents"][row])
        ids.append(tensors["input_ids"][row])
    return torch.stack(lat).float(), torch.stack(ids).long()


def test_gather_returns_the_indexed_rows_in_request_order(store):
    data = LatentIndexDataset(store / "idx.parquet", store, RES)
    assert len(data) == 41 and data.latent_shape == (4, 2, 2)
    for positions in (np.arange(41), np.array([40, 3, 3, 17, 0, 22, 9])):
        latents, ids = data.gather(positions)
        want_lat, want_ids = _expected(store, positions)
        assert latents.dtype == torch.float32 and ids.dtype == torch.int64
        assert torch.equal(latents, want_lat) and torch.equal(ids, want_ids)


def test_missing_shard_names_index_source_and_shard(store):
    shard_path(store, "a", RES, 1, SQ).unlink()
    message = r"idx\.parquet: source 'a' shard 1 bucket 4x4: .*shard-00001-4x4\.safetensors does not exist"
    with pytest.raises(InputError, match=message):
        LatentIndexDataset(store / "idx.parquet", store, RES)


def test_damaged_shard_names_index_source_and_shard(store):
    path = shard_path(store, "b", RES, 0, SQ)
    path.write_bytes(path.read_bytes()[:-100])  # truncated tensor data
    with pytest.raises(InputError, match=r"idx\.parquet: source 'b' shard 0 bucket 4x4: .*shard-00000-4x4.*truncated"):
        LatentIndexDataset(store / "idx.parquet", store, RES)


def test_row_past_the_shard_end_is_named(store):
    index = pl.read_parquet(store / "idx.parquet")
    bad = pl.DataFrame(
        {"source": ["b"], "shard": [1], "bucket_width": [4], "bucket_height": [4], "row": [ROWS], "key": ["k"]}
    )
    pl.concat([index, bad]).write_parquet(store / "idx.parquet")
    with pytest.raises(InputError, match=r"idx\.parquet: source 'b' shard 1 .* has 10 rows .* row\(s\) \[10\]"):
        LatentIndexDataset(store / "idx.parquet", store, RES)


def test_empty_index_is_an_error(store):
    pl.read_parquet(store / "idx.parquet").head(0).write_parquet(store / "idx.parquet")
    with pytest.raises(InputError, match="is empty"):
        LatentIndexDataset(store / "idx.parquet", store, RES)


def test_ranks_get_disjoint_equal_batches_covering_the_epoch(store):
    data = LatentIndexDataset(store / "idx.parquet", store, RES)
    world, batch = 3, 4  # 41 samples → 3 global batches of 12 (5 left out), 3 batches of 4 per rank
    seen = []
    for rank in range(world):
        spy = _Spy(data)
        batches = list(iter_batches(spy, rank_batches(data.sample_bucket, 0, 5, rank, BatchSplit(batch, 1, world))))
        assert [b for b, _, _ in batches] == [0, 1, 2] and [len(lat) for _, lat, _ in batches] == [4, 4, 4]
        positions = np.concatenate(spy.gathered)
        assert torch.equal(torch.cat([lat for _, lat, _ in batches]), _expected(store, positions)[0])
        seen.append(positions)
    flat = np.concatenate(seen)
    assert len(flat) == len(set(flat.tolist())) == 36


class _Spy:
    """A dataset wrapper that records which positions were gathered."""

    def __init__(self, data):
        self.data, self.gathered = data, []

    def __len__(self):
        return len(self.data)

    def gather(self, positions):
        self.gathered.append(np.asarray(positions).copy())
        return self.data.gather(positions)

    def prefetch(self, positions):
        self.data.prefetch(positions)


@pytest.mark.parametrize(("rank", "start"), [(0, 3), (1, 1), (1, 5), (0, 5)])
def test_resume_at_batch_k_yields_exactly_the_rest_of_the_epoch(store, rank, start):
    data = LatentIndexDataset(store / "idx.parquet", store, RES)
    batches = rank_batches(data.sample_bucket, 1, 0, rank, BatchSplit(3, 1, 2))
    full = list(iter_batches(data, batches))
    assert len(full) == 41 // 6 == 6
    spy = _Spy(data)
    resumed = list(iter_batches(spy, batches, start_batch=start))
    assert [b for b, _, _ in resumed] == list(range(start, 6))
    for (b1, l1, i1), (b2, l2, i2) in zip(full[start:], resumed, strict=True):
        assert b1 == b2 and torch.equal(l1, l2) and torch.equal(i1, i2)
    skipped = set(np.concatenate(batches[:start]).tolist())
    assert not skipped & set(np.concatenate(spy.gathered).tolist())  # skipped batches were never read


# ------------------------------------------------------------------------------- several buckets

BUCKETS = {(4, 4): (2, 2), (6, 2): (1, 3), (2, 6): (3, 1)}  # bucket (w, h) px → latent (h, w) at f = 2


@pytest.fixture
def bucket_store(tmp_path):
    """Two sources × two shards × three buckets; each latent row's first element names its bucket."""
    rows = []
    for source in ("a", "b"):
        for shard in range(2):
            for b, (bucket, (lh, lw)) in enumerate(BUCKETS.items()):
                n = 7 + b  # unequal bucket sizes: some tails
                lat = torch.full((n, 4, lh, lw), float(b)) + torch.arange(n, dtype=torch.float32).view(n, 1, 1, 1) / 16
                ids = torch.full((n, 77), b, dtype=torch.int32)
                write_shard(shard_path(tmp_path, source, "mix", shard, bucket), lat, ids)
                rows += [(source, shard, *bucket, r) for r in range(n)]
    columns = ["source", "shard", "bucket_width", "bucket_height", "row"]
    index = pl.DataFrame(rows, schema=columns, orient="row").sample(fraction=1.0, shuffle=True, seed=3)
    index.with_columns(key=pl.lit("k")).write_parquet(tmp_path / "idx.parquet")
    return tmp_path


def _epoch(data, epoch, rank, world, batch, tail="drop", start=0):
    batches = rank_batches(data.sample_bucket, epoch, 11, rank, BatchSplit(batch, 1, world), tail)
    return batches, list(iter_batches(data, batches, start_batch=start))


def test_no_batch_mixes_shapes_over_an_epoch_on_two_ranks(bucket_store):
    data = LatentIndexDataset(bucket_store / "idx.parquet", bucket_store, "mix")
    assert len(data) == 2 * 2 * (7 + 8 + 9) and data.buckets == [(2, 6), (4, 4), (6, 2)]
    per_rank = [_epoch(data, 0, rank, 2, 3) for rank in range(2)]
    (b0, got0), (b1, got1) = per_rank
    assert len(got0) == len(got1) == 15  # buckets of 28/32/36 samples → 4 + 5 + 6 global batches of 2 × 3
    for (_, lat0, ids0), (_, lat1, ids1) in zip(got0, got1, strict=True):
        assert lat0.shape == lat1.shape and lat0.shape[0] == 3  # same shape on both ranks at every step
        assert len(torch.unique(ids0[:, 0])) == len(torch.unique(ids1[:, 0])) == 1  # one bucket per batch
        assert ids0[0, 0] == ids1[0, 0]
    flat = np.concatenate(b0 + b1)
    assert len(flat) == len(set(flat.tolist())) == 15 * 6  # disjoint ranks


@pytest.mark.parametrize(("rank", "start"), [(0, 0), (0, 5), (1, 9), (1, 13)])
@pytest.mark.parametrize("tail", ["drop", "carry"])
def test_bucketed_resume_at_batch_k_is_exactly_the_rest(bucket_store, rank, start, tail):
    data = LatentIndexDataset(bucket_store / "idx.parquet", bucket_store, "mix")
    _, full = _epoch(data, 2, rank, 2, 3, tail)
    spy = _Spy(data)
    batches = rank_batches(data.sample_bucket, 2, 11, rank, BatchSplit(3, 1, 2), tail)
    resumed = list(iter_batches(spy, batches, start_batch=start))
    assert [b for b, _, _ in resumed] == list(range(start, len(full)))
    for (b1, l1, i1), (b2, l2, i2) in zip(full[start:], resumed, strict=True):
        assert b1 == b2 and torch.equal(l1, l2) and torch.equal(i1, i2)
    skipped = set(np.concatenate(batches[:start] or [np.array([], int)]).tolist())
    assert not skipped & set(np.concatenate(spy.gathered or [np.array([], int)]).tolist())


def test_epochs_summary_counts_trained_and_left_out_per_bucket(bucket_store):
    data = LatentIndexDataset(bucket_store / "idx.parquet", bucket_store, "mix")
    lengths, counts = epochs_summary(data, 3, 11, global_batch=6, tail="drop")
    # buckets 2x6 / 4x4 / 6x2 hold 36 / 28 / 32 samples (7+b rows per shard, b = the BUCKETS position)
    assert lengths == [15, 15, 15]
    assert counts == {
        "bucket.2x6.samples": 36 * 3,
        "bucket.2x6.left_out": 0,
        "bucket.4x4.samples": 24 * 3,
        "bucket.4x4.left_out": 4 * 3,
        "bucket.6x2.samples": 30 * 3,
        "bucket.6x2.left_out": 2 * 3,
    }
    lengths, counts = epochs_summary(data, 3, 11, global_batch=6, tail="carry")
    assert sum(counts[k] for k in counts if k.endswith(".samples")) == 6 * sum(lengths)
    assert lengths[0] == 15 and max(lengths) >= 15


def test_a_batch_of_two_buckets_is_refused(bucket_store):
    data = LatentIndexDataset(bucket_store / "idx.parquet", bucket_store, "mix")
    two = [int(np.flatnonzero(data.sample_bucket == b)[0]) for b in (0, 1)]
    with pytest.raises(ValueError, match="mixes buckets"):
        data.gather(np.array(two))
