"""Phase mixing: exact composition, determinism, clear error on a too-small source."""

import hashlib

import polars as pl
import pytest
from pydantic import ValidationError

from sdforge.config import Phase
from sdforge.io import InputError
from sdforge.latents.mix import smallest_total, split_counts
from stages.mix_phase import build_index, index_digest, requested_counts, run


def _manifest(source, n):
    return pl.DataFrame(
        {
            "key": [f"{source}{i:04d}" for i in range(n)],
            "source": [source] * n,
            "shard": [i // 10 for i in range(n)],
            "bucket_width": [32] * n,
            "bucket_height": [32] * n,
            "row": [i % 10 for i in range(n)],
        }
    )


RES = "sq"  # the resolution folder these tests write their manifests in


def _write(root, source, frame):
    (root / source / RES).mkdir(parents=True, exist_ok=True)
    frame.write_parquet(root / source / RES / "manifest.parquet")


def _phase(**kw):
    base = dict(mix={"a": 0.37, "b": 0.63}, samples=100, lr=1e-4)
    return Phase(**{**base, **kw})


def test_split_counts_sum_exactly():
    assert split_counts({"a": 0.37, "b": 0.44, "c": 0.09, "d": 0.10}, 572) == {"a": 212, "b": 252, "c": 51, "d": 57}
    assert sum(split_counts({"x": 1 / 3, "y": 1 / 3, "z": 1 / 3}, 10).values()) == 10


def test_smallest_total_gives_every_source_a_sample():
    final_mix = {"laion_hq": 0.37, "diffusiondb": 0.22, "journeydb": 0.22, "vggface2": 0.09, "coco": 0.10}
    assert smallest_total(final_mix, 2) == 6  # 2, 1, 1, 1, 1 (largest remainders: not monotonic in the total)
    assert split_counts(final_mix, 6) == {"laion_hq": 2, "diffusiondb": 1, "journeydb": 1, "vggface2": 1, "coco": 1}
    assert split_counts(final_mix, 8)["vggface2"] == 0 and smallest_total(final_mix, 4) == 12
    assert smallest_total({"a": 0.42, "b": 0.58}, 2) == 2
    assert smallest_total({"a": 1.0}, 3) == 3


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
    with pytest.raises(InputError, match="'a' has 10 samples to train on but the mix asks for 37.*with_replacement"):
        build_index("phase7", _phase(), manifests, seed=0)


def test_with_replacement_fills_the_request():
    manifests = {"a": _manifest("a", 10), "b": _manifest("b", 90)}
    idx = build_index("phase7", _phase(with_replacement=True), manifests, seed=0)
    assert dict(idx.group_by("source").len().iter_rows())["a"] == 37


def test_run_writes_parquet_and_metrics(tmp_path):
    for s, n in (("a", 50), ("b", 70)):
        _write(tmp_path / "lat", s, _manifest(s, n))
    metrics = run("p", _phase(samples=60), tmp_path / "lat", tmp_path / "mix" / "p.parquet", seed=3, resolution=RES)
    idx = pl.read_parquet(tmp_path / "mix" / "p.parquet")
    assert idx.columns == ["source", "shard", "bucket_width", "bucket_height", "row", "key"]
    assert metrics["bucket.32x32"] == 60
    assert metrics["samples"] == 60 and metrics["samples.a"] == 22 and metrics["samples.b"] == 38
    assert metrics["requested_fraction.a"] == 0.37 and metrics["obtained_fraction.a"] == pytest.approx(22 / 60)


def _golden_manifests():
    """A fixed synthetic store: three sources of 1000/37/400 samples in shards of 128 rows."""
    return {s: _manifest_sharded(s, n) for s, n in (("laion", 1000), ("coco", 37), ("vgg", 400))}


def _manifest_sharded(source, n, shard_size=128):
    return pl.DataFrame(
        {
            "key": [f"{source}-{i:05d}" for i in range(n)],
            "source": [source] * n,
            "shard": [i // shard_size for i in range(n)],
            "bucket_width": [32] * n,
            "bucket_height": [32] * n,
            "row": [i % shard_size for i in range(n)],
        }
    )


@pytest.mark.parametrize(
    ("with_replacement", "digest"),
    [
        (False, "c9fd4b58587425e8d5a12907007a2fb92b8226f6875704a2c194f2637e7b4e9d"),
        (True, "6080d6b5277bba54728042a4d7a657cf8810f3b4a89f10f2dbe5a417ed41e0ff"),
    ],
)
def test_golden_index_digest(with_replacement, digest):
    """The index for a seed is pinned: a changed digest means a changed training order on some machine.

    ``digest`` is over (source, shard, row, key), as pinned before buckets existed: with one square bucket
    the selection and order are unchanged. :func:`index_digest` (which adds the bucket) is pinned below."""
    phase = _phase(mix={"laion": 0.6, "coco": 0.1, "vgg": 0.3}, samples=300, with_replacement=with_replacement)
    index = build_index("phase6", phase, _golden_manifests(), seed=0)
    assert dict(index.group_by("source").len().iter_rows()) == {"laion": 180, "coco": 30, "vgg": 90}
    rows = index.select("source", "shard", "row", "key").iter_rows()
    text = "".join(f"{so}\t{sh}\t{r}\t{k}\n" for so, sh, r, k in rows)
    assert hashlib.sha256(text.encode()).hexdigest() == digest
    assert index_digest(index) == GOLDEN_WITH_BUCKETS[with_replacement]


GOLDEN_WITH_BUCKETS = {
    False: "d172e83a02804c2dcc9e262ece4b62d0f13f0e63601931cd4cfcdaa1701e3ecc",
    True: "8db8b57d6e5bf241964e377217cded9163b6ac37efb20b4625bb4989e2733198",
}


def test_index_ignores_manifest_row_order():
    manifests = _golden_manifests()
    shuffled = {s: m.sample(fraction=1.0, shuffle=True, seed=1) for s, m in manifests.items()}
    phase = _phase(mix={"laion": 0.6, "coco": 0.1, "vgg": 0.3}, samples=300)
    assert build_index("p", phase, manifests, seed=4).equals(build_index("p", phase, shuffled, seed=4))


def test_counts_mix_gives_exact_counts():
    phase = _phase(mix={"laion": 150, "coco": 37, "vgg": 13}, samples=200)
    index = build_index("p", phase, _golden_manifests(), seed=0)
    assert dict(index.group_by("source").len().iter_rows()) == {"laion": 150, "coco": 37, "vgg": 13}
    assert index.unique(["source", "shard", "row"]).height == 200
    assert requested_counts("p", phase) == {"laion": 150, "coco": 37, "vgg": 13}


@pytest.mark.parametrize(
    ("mix", "samples", "message"),
    [
        ({"a": 10, "b": 20}, 31, "counts sum to 30 but samples is 31"),
        ({"a": 1}, 480, "counts sum to 1 but samples is 480.*1.0"),
        ({"a": 0.5, "b": 20}, 40, "all fractions .* or all sample counts"),
        ({"a": 0, "b": 20}, 20, "counts must be >= 1"),
    ],
)
def test_phase_mix_kinds_are_validated(mix, samples, message):
    with pytest.raises(ValidationError, match=message):
        _phase(mix=mix, samples=samples)


def test_a_source_rounded_to_zero_samples_is_an_error():
    with pytest.raises(InputError, match="source 'b' at fraction 0.001 gets 0 of 100 samples"):
        requested_counts("p", _phase(mix={"a": 0.999, "b": 0.001}))


def test_counts_beyond_a_source_need_replacement():
    manifests = _golden_manifests()
    with pytest.raises(InputError, match="source 'coco' has 37 samples to train on but the mix asks for 50"):
        build_index("p", _phase(mix={"laion": 50, "coco": 50}, samples=100), manifests, seed=0)
    index = build_index("p", _phase(mix={"laion": 50, "coco": 50}, samples=100, with_replacement=True), manifests, 0)
    coco = index.filter(pl.col("source") == "coco")
    assert coco.height == 50 and coco["key"].n_unique() <= 37


def test_manifest_checks(tmp_path):
    (tmp_path / "lat" / "a" / RES).mkdir(parents=True)
    with pytest.raises(InputError, match=r"a/sq/manifest.parquet: missing .*encode_latents@a"):
        run("p", _phase(mix={"a": 1.0}, samples=5), tmp_path / "lat", tmp_path / "p.parquet", seed=0, resolution=RES)
    dup = pl.concat([_manifest("a", 20), _manifest("a", 20).head(1)])
    dup.write_parquet(tmp_path / "lat" / "a" / RES / "manifest.parquet")
    with pytest.raises(InputError, match=r"manifest lists a \(shard, bucket, row\) twice"):
        run("p", _phase(mix={"a": 1.0}, samples=5), tmp_path / "lat", tmp_path / "p.parquet", seed=0, resolution=RES)


def test_run_is_deterministic_on_disk(tmp_path):
    for s, n in (("a", 50), ("b", 70)):
        _write(tmp_path / "lat", s, _manifest(s, n))
    digests = []
    for name in ("x", "y"):
        run("p", _phase(samples=60), tmp_path / "lat", tmp_path / name / "p.parquet", seed=3, resolution=RES)
        digests.append(index_digest(pl.read_parquet(tmp_path / name / "p.parquet")))
    assert digests[0] == digests[1]


def test_unreadable_or_short_manifest_is_an_input_error_naming_the_file(tmp_path):
    """A truncated manifest or one without the index columns names the file and what to re-run."""
    from stages.mix_phase import read_manifest

    (tmp_path / "a" / RES).mkdir(parents=True)
    path = tmp_path / "a" / RES / "manifest.parquet"
    bucket = {"bucket_width": [8], "bucket_height": [8]}
    pl.DataFrame({"key": ["x"], "shard": [0], **bucket, "row": [0]}).write_parquet(path)
    path.write_bytes(path.read_bytes()[:-20])
    with pytest.raises(InputError, match=r"a/sq/manifest.parquet: unreadable parquet .*re-run encode_latents@a"):
        read_manifest(tmp_path, "a", RES)
    pl.DataFrame({"key": ["x"], "shard": [0], **bucket}).write_parquet(path)
    with pytest.raises(InputError, match=r"sq/manifest.parquet: lacks column\(s\) \['row'\]; re-run encode_latents@a"):
        read_manifest(tmp_path, "a", RES)


def test_held_out_samples_are_the_same_in_every_phase_and_never_in_an_index(tmp_path):
    """train.held_out: each source's keys of lowest SHA-256(source/key) go to <phase>.held_out.parquet, in every
    phase alike."""
    _write(tmp_path / "lat", "a", _manifest("a", 80))
    _write(tmp_path / "lat", "b", _manifest("b", 90))
    out = tmp_path / "mix"
    first = run("p1", _phase(samples=60), tmp_path / "lat", out / "p1.parquet", seed=3, resolution=RES, held_out=5)
    run("p2", _phase(mix={"b": 1.0}, samples=40), tmp_path / "lat", out / "p2.parquet", seed=9, resolution=RES,
        held_out=5)  # fmt: skip
    held1, held2 = pl.read_parquet(out / "p1.held_out.parquet"), pl.read_parquet(out / "p2.held_out.parquet")
    def digest(source, key):
        return hashlib.sha256(f"{source}/{key}".encode()).digest()

    by_digest = {s: sorted((f"{s}{i:04d}" for i in range(n)), key=lambda k, s=s: digest(s, k))
                 for s, n in (("a", 80), ("b", 90))}  # fmt: skip
    expected = {s: sorted(keys[:5]) for s, keys in by_digest.items()}
    assert {s: sorted(held1.filter(pl.col("source") == s)["key"]) for s in "ab"} == expected
    assert sorted(held2["key"]) == expected["b"] and held2.columns == held1.columns
    index = pl.read_parquet(out / "p1.parquet")
    assert not set(index["key"]) & set(held1["key"]) and index.height == 60
    assert (first["held_out"], first["held_out.a"], first["held_out.b"]) == (10, 5, 5)
    assert (first["available.a"], first["available.b"]) == (75, 85)


def test_holding_out_a_whole_source_is_refused_by_key(tmp_path):
    _write(tmp_path / "lat", "a", _manifest("a", 6))
    with pytest.raises(InputError, match="train.held_out = 6: source 'a' has only 6 samples"):
        run("p", _phase(mix={"a": 1.0}, samples=5), tmp_path / "lat", tmp_path / "p.parquet", seed=0,
            resolution=RES, held_out=6)  # fmt: skip
    run("p", _phase(mix={"a": 1.0}, samples=5), tmp_path / "lat", tmp_path / "p.parquet", seed=0, resolution=RES)
    assert pl.read_parquet(tmp_path / "p.held_out.parquet").height == 0  # held_out 0: an empty companion
