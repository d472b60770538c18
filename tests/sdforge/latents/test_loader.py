"""Latent loader: gathers the indexed rows from memmapped shards, validates the index, disjoint ranks, exact resume."""

import numpy as np
import polars as pl
import pytest
import torch
from safetensors.torch import load_file

from sdforge.io import InputError
from sdforge.latents.loader import LatentIndexDataset, batches_per_epoch, iter_batches, rank_order
from sdforge.latents.store import shard_path, write_shard

ROWS = 10  # per shard


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
            write_shard(shard_path(tmp_path, source, shard), *_shard_values(source, shard))
    rng = np.random.default_rng(0)
    n = 41
    index = pl.DataFrame(
        {
            "source": rng.choice(["a", "b"], n).tolist(),
            "shard": rng.integers(0, 2, n).tolist(),
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
        source, shard, row = index.row(int(p))[:3]
        tensors = load_file(shard_path(store, source, shard))
        lat.append(tensors["latents"][row])
        ids.append(tensors["input_ids"][row])
    return torch.stack(lat).float(), torch.stack(ids).long()


def test_gather_returns_the_indexed_rows_in_request_order(store):
    data = LatentIndexDataset(store / "idx.parquet", store)
    assert len(data) == 41 and data.latent_shape == (4, 2, 2)
    for positions in (np.arange(41), np.array([40, 3, 3, 17, 0, 22, 9])):
        latents, ids = data.gather(positions)
        want_lat, want_ids = _expected(store, positions)
        assert latents.dtype == torch.float32 and ids.dtype == torch.int64
        assert torch.equal(latents, want_lat) and torch.equal(ids, want_ids)


def test_missing_shard_names_index_source_and_shard(store):
    shard_path(store, "a", 1).unlink()
    message = r"idx\.parquet: source 'a' shard 1: .*shard-00001\.safetensors does not exist"
    with pytest.raises(InputError, match=message):
        LatentIndexDataset(store / "idx.parquet", store)


def test_damaged_shard_names_index_source_and_shard(store):
    path = shard_path(store, "b", 0)
    path.write_bytes(path.read_bytes()[:-100])  # truncated tensor data
    with pytest.raises(InputError, match=r"idx\.parquet: source 'b' shard 0: .*shard-00000\.safetensors.*truncated"):
        LatentIndexDataset(store / "idx.parquet", store)


def test_row_past_the_shard_end_is_named(store):
    index = pl.read_parquet(store / "idx.parquet")
    bad = pl.DataFrame({"source": ["b"], "shard": [1], "row": [ROWS], "key": ["k"]})
    pl.concat([index, bad]).write_parquet(store / "idx.parquet")
    with pytest.raises(InputError, match=r"idx\.parquet: source 'b' shard 1 .* has 10 rows .* row\(s\) \[10\]"):
        LatentIndexDataset(store / "idx.parquet", store)


def test_empty_index_is_an_error(store):
    pl.read_parquet(store / "idx.parquet").head(0).write_parquet(store / "idx.parquet")
    with pytest.raises(InputError, match="is empty"):
        LatentIndexDataset(store / "idx.parquet", store)


def test_rank_orders_are_disjoint_and_equal_length():
    orders = [rank_order(103, epoch=2, seed=7, rank=r, world=4) for r in range(4)]
    assert all(len(o) == 25 for o in orders)
    flat = [int(i) for o in orders for i in o]
    assert len(set(flat)) == 100
    assert (rank_order(103, 2, 7, 0, 4) == orders[0]).all()
    assert not (rank_order(103, 3, 7, 0, 4) == orders[0]).all()


def test_ranks_get_disjoint_equal_batches_covering_the_epoch(store):
    data = LatentIndexDataset(store / "idx.parquet", store)
    world, batch = 3, 4  # 41 samples → 39 usable, 13 per rank → 4 batches (last one partial)
    seen = []
    for rank in range(world):
        spy = _Spy(data)
        batches = list(iter_batches(spy, epoch=0, seed=5, rank=rank, world=world, batch_size=batch))
        assert [b for b, _, _ in batches] == [0, 1, 2, 3] and [len(lat) for _, lat, _ in batches] == [4, 4, 4, 1]
        positions = np.concatenate(spy.gathered)
        assert torch.equal(torch.cat([lat for _, lat, _ in batches]), _expected(store, positions)[0])
        seen.append(positions)
    flat = np.concatenate(seen)
    assert len(flat) == len(set(flat.tolist())) == 39
    assert set(flat.tolist()) == set(np.random.default_rng([5, 0]).permutation(41)[:39].tolist())


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


@pytest.mark.parametrize(("rank", "start"), [(0, 3), (1, 1), (1, 5), (0, 6)])
def test_resume_at_batch_k_yields_exactly_the_rest_of_the_epoch(store, rank, start):
    data = LatentIndexDataset(store / "idx.parquet", store)
    full = list(iter_batches(data, epoch=1, seed=0, rank=rank, world=2, batch_size=3))
    assert len(full) == batches_per_epoch(41, 2, 3) == 7
    spy = _Spy(data)
    resumed = list(iter_batches(spy, epoch=1, seed=0, rank=rank, world=2, batch_size=3, start_batch=start))
    assert [b for b, _, _ in resumed] == list(range(start, 7))
    for (b1, l1, i1), (b2, l2, i2) in zip(full[start:], resumed, strict=True):
        assert b1 == b2 and torch.equal(l1, l2) and torch.equal(i1, i2)
    skipped = set(rank_order(41, 1, 0, rank, 2)[: start * 3].tolist())
    assert not skipped & set(np.concatenate(spy.gathered).tolist())  # skipped batches were never read
