"""Latent loader: gathers the indexed rows, disjoint per-rank slices, exact mid-epoch resume."""

import polars as pl
import pytest
import torch
from safetensors.torch import save_file

from stages.common import InputError
from stages.latent_loader import LatentIndexDataset, batches_per_epoch, iter_batches, rank_order


@pytest.fixture
def store(tmp_path):
    for s in ("a", "b"):
        (tmp_path / s).mkdir()
        for shard in range(2):
            base = (0 if s == "a" else 100) + shard * 10
            lat = torch.arange(base, base + 10, dtype=torch.float16).view(10, 1, 1, 1).expand(10, 4, 2, 2)
            ids = torch.arange(base, base + 10, dtype=torch.int32).view(10, 1).expand(10, 77)
            save_file({"latents": lat.contiguous(), "input_ids": ids.contiguous()},
                      tmp_path / s / f"shard-{shard:05d}.safetensors")
    index = pl.DataFrame({"source": ["b", "a", "a", "b", "a"], "shard": [1, 0, 1, 0, 1], "row": [3, 2, 9, 0, 0],
                          "key": ["k"] * 5})
    index.write_parquet(tmp_path / "idx.parquet")
    return tmp_path


def test_dataset_gathers_rows_in_index_order(store):
    data = LatentIndexDataset(store / "idx.parquet", store)
    assert len(data) == 5
    assert data.latents[:, 0, 0, 0].tolist() == [113, 2, 19, 100, 10]
    assert data.input_ids[:, 5].tolist() == [113, 2, 19, 100, 10]
    assert data.latents.dtype == torch.float16


def test_missing_shard_is_named(store):
    (store / "a" / "shard-00001.safetensors").unlink()
    with pytest.raises(InputError, match="shard-00001.safetensors"):
        LatentIndexDataset(store / "idx.parquet", store)


def test_ranks_are_disjoint_and_equal_length():
    orders = [rank_order(103, epoch=2, seed=7, rank=r, world=4) for r in range(4)]
    assert all(len(o) == 25 for o in orders)
    flat = [int(i) for o in orders for i in o]
    assert len(set(flat)) == 100
    assert (rank_order(103, 2, 7, 0, 4) == orders[0]).all()
    assert not (rank_order(103, 3, 7, 0, 4) == orders[0]).all()


@pytest.mark.parametrize("rank", [0, 1])
def test_resume_at_batch_k_yields_the_same_batches(rank):
    class Fake:
        latents = torch.arange(50, dtype=torch.float16).view(50, 1)
        input_ids = torch.arange(50).view(50, 1)

        def __len__(self):
            return 50

    full = list(iter_batches(Fake(), epoch=1, seed=0, rank=rank, world=2, batch_size=4))
    assert len(full) == batches_per_epoch(50, 2, 4) == 7
    resumed = list(iter_batches(Fake(), epoch=1, seed=0, rank=rank, world=2, batch_size=4, start_batch=3))
    assert [b for b, _, _ in resumed] == [3, 4, 5, 6]
    for (b1, l1, i1), (b2, l2, i2) in zip(full[3:], resumed, strict=True):
        assert b1 == b2 and torch.equal(l1, l2) and torch.equal(i1, i2)
