"""Phase mixing: exact composition, determinism, clear error on a too-small source."""

import polars as pl
import pytest

from stages.common import InputError
from stages.config import Phase
from stages.mix_phase import build_index, run, split_counts


def _manifest(source, n):
    return pl.DataFrame({"key": [f"{source}{i:04d}" for i in range(n)], "source": [source] * n,
                         "shard": [i // 10 for i in range(n)], "row": [i % 10 for i in range(n)]})


def _phase(**kw):
    base = dict(mix={"a": 0.37, "b": 0.63}, samples=100, lr=1e-4)
    return Phase(**{**base, **kw})


def test_split_counts_sum_exactly():
    assert split_counts({"a": 0.37, "b": 0.44, "c": 0.09, "d": 0.10}, 572) == {"a": 212, "b": 252, "c": 51, "d": 57}
    assert sum(split_counts({"x": 1 / 3, "y": 1 / 3, "z": 1 / 3}, 10).values()) == 10


def test_index_composition_and_determinism():
    manifests = {"a": _manifest("a", 80), "b": _manifest("b", 90)}
    first = build_index("phase7", _phase(), manifests, seed=0)
    again = build_index("phase7", _phase(), manifests, seed=0)
    other_seed = build_index("phase7", _phase(), manifests, seed=1)
    assert first.equals(again)
    assert not first.equals(other_seed)
    counts = dict(first.group_by("source").len().iter_rows())
    assert counts == {"a": 37, "b": 63}
    assert first.unique(["source", "key"]).height == 100  # without replacement: no repeats


def test_too_few_samples_is_a_clear_error():
    manifests = {"a": _manifest("a", 10), "b": _manifest("b", 90)}
    with pytest.raises(InputError, match="source 'a' has 10 samples but the mix asks for 37.*with_replacement"):
        build_index("phase7", _phase(), manifests, seed=0)


def test_with_replacement_fills_the_request():
    manifests = {"a": _manifest("a", 10), "b": _manifest("b", 90)}
    idx = build_index("phase7", _phase(with_replacement=True), manifests, seed=0)
    assert dict(idx.group_by("source").len().iter_rows())["a"] == 37


def test_run_writes_parquet_and_metrics(tmp_path):
    for s, n in (("a", 50), ("b", 70)):
        (tmp_path / "lat" / s).mkdir(parents=True)
        _manifest(s, n).write_parquet(tmp_path / "lat" / s / "manifest.parquet")
    metrics = run("p", _phase(samples=60), tmp_path / "lat", tmp_path / "mix" / "p.parquet", seed=3)
    idx = pl.read_parquet(tmp_path / "mix" / "p.parquet")
    assert idx.columns == ["source", "shard", "row", "key"]
    assert metrics["samples"] == 60 and metrics["samples.a"] == 22 and metrics["samples.b"] == 38
    assert metrics["requested_fraction.a"] == 0.37 and metrics["obtained_fraction.a"] == pytest.approx(22 / 60)
