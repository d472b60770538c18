"""Issue 39, item 4: a ``hypothesis`` property test per entry point where data enters a stage (docs/INPUTS.md).

Each is fed nested (up to 200,000 levels), huge, truncated, mis-typed and random values, and must answer with a
counted rejection (a reason its stage counts) or a named error (``InputError`` / ``ConfigError``) — never another
exception (``RecursionError``, a library's traceback) — while the good sample beside the bad one is kept. The
growth of the process's peak RSS over each test is held under :data:`MEMORY_CEILING_MIB` (the whole suite shares
one process, so a test can only raise the peak it finds). Example counts: :data:`EXAMPLES`.
"""

from __future__ import annotations

import contextlib
import io
import json
import resource
import tempfile
import zipfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from sdforge.bounds import json_docs
from sdforge.bounds.captions import decode_caption
from sdforge.captions.shards import TOO_LARGE, UNREADABLE, _decode
from sdforge.config import ConfigError, FilterRules, InputLimits
from sdforge.config.params import read_yaml_bounded
from sdforge.ingest.shards import tar_bytes
from sdforge.ingest.sources import coco, diffusiondb, journeydb, local
from sdforge.io import InputError
from sdforge.latents.inputs import decode_sample, iter_tar_groups
from tests.fixtures.params_bombs import alias_bomb
from tests.fixtures.sources import RED, image_bytes

EXAMPLES = 150
MEMORY_CEILING_MIB = 256
LIMITS = InputLimits(json_max_depth=32, json_max_bytes=64 << 10, json_max_entries=5_000)
"""Small on purpose, so that huge values cross a bound with a few hundred KiB of test data."""
SLOW_OK = [HealthCheck.too_slow, HealthCheck.function_scoped_fixture]  # the fixture measures the whole test
CHECKS = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=SLOW_OK)
FILE_CHECKS = settings(max_examples=60, deadline=None, suppress_health_check=SLOW_OK)
GOOD_PNG = image_bytes(40, 40, RED, "PNG")

scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=40))
values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=8), inner, max_size=6),
    max_leaves=40,
)  # fmt: skip


@st.composite
def hostile_json(draw) -> bytes:
    """JSON text that is deep, huge, truncated, random or of the wrong shape (each a draw of its own kind)."""
    kind = draw(st.sampled_from(["deep", "huge", "truncated", "random", "mistyped", "record"]))
    if kind == "deep":
        depth = draw(st.sampled_from([33, 901, 5_000, 200_000]))
        opener, closer = draw(st.sampled_from([("[", "]"), ('{"a":', "}")]))
        return (opener * depth + "1" + closer * depth).encode()
    if kind == "huge":
        n = draw(st.integers(10_000, 200_000))
        shape = draw(st.sampled_from(["string", "list", "object"]))
        doc = {"string": "x" * n, "list": [0] * (n // 2), "object": {"p": "y" * n}}[shape]
        return json.dumps(doc).encode()
    if kind == "truncated":
        text = json.dumps(draw(values)).encode()
        return text[: draw(st.integers(0, max(len(text) - 1, 0)))]
    if kind == "random":
        return draw(st.binary(max_size=300))
    if kind == "mistyped":
        return json.dumps(draw(values)).encode()
    record = {"img_path": draw(st.one_of(st.text(max_size=20), scalars)), "prompt": draw(values), "p": draw(values),
              "tags": draw(values), "score": draw(values)}  # fmt: skip
    return json.dumps(record).encode()


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


RAN = Counter()


@pytest.fixture
def memory_ceiling(request):
    """Fails the test when it raised the process's peak RSS by more than :data:`MEMORY_CEILING_MIB`; prints how
    many examples it ran (``pytest -s``)."""
    before = _peak_mib()
    yield
    grown = _peak_mib() - before
    print(f"\n{request.node.name}: {RAN[request.node.name]} examples, peak RSS growth {grown:.0f} MiB")
    assert grown < MEMORY_CEILING_MIB, f"the peak RSS grew {grown:.0f} MiB"


@CHECKS
@given(data=hostile_json(), limits=st.sampled_from([LIMITS, json_docs.DEFAULT_LIMITS]))
def test_bounded_json_answers_a_value_or_a_value_error(data, limits, memory_ceiling):
    RAN["test_bounded_json_answers_a_value_or_a_value_error"] += 1
    try:
        json_docs.loads(data, limits)
    except json_docs.JsonLimitError as err:
        assert err.reason in json_docs.REASONS
    except ValueError:
        pass


@CHECKS
@given(line=hostile_json())
def test_a_journeydb_line_is_a_record_or_a_counted_reason(line, memory_ceiling):
    RAN["test_a_journeydb_line_is_a_record_or_a_counted_reason"] += 1
    record, reason = journeydb.parse_record(line, LIMITS)
    assert (record is None) == bool(reason) and reason in ("", *journeydb.REASONS)


@CHECKS
@given(text=hostile_json())
def test_a_local_tag_file_is_tags_or_a_counted_drop(text, memory_ceiling):
    RAN["test_a_local_tag_file_is_tags_or_a_counted_drop"] += 1
    try:
        tags, _ = local.parse_tags(text.decode("utf-8", errors="replace"), LIMITS)
    except local.Dropped as dropped:
        assert dropped.reason in local.REASONS
    else:
        assert all(isinstance(t, str) for t in tags)


@contextlib.contextmanager
def _file_holding(name: str, data: bytes) -> Iterator[Path]:
    """A temporary file ``name`` holding ``data`` (hypothesis runs many examples per test: no ``tmp_path``)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / name
        path.write_bytes(data)
        yield path


def _diffusiondb_parts(root: Path, mapping: bytes) -> None:
    """``part-000001.zip`` with an image and the hostile JSON mapping; ``part-000002.zip`` good."""
    for part, text in ((1, mapping), (2, json.dumps({"good.png": {"p": "a red square"}}).encode())):
        with zipfile.ZipFile(root / f"part-{part:06d}.zip", "w") as zf:
            zf.writestr("bad.png" if part == 1 else "good.png", GOOD_PNG)
            zf.writestr(f"part-{part:06d}.json", text)


@FILE_CHECKS
@given(mapping=hostile_json())
def test_a_hostile_diffusiondb_mapping_costs_its_part_at_most_and_the_good_part_is_kept(mapping, memory_ceiling):
    RAN["test_a_hostile_diffusiondb_mapping_costs_its_part_at_most_and_the_good_part_is_kept"] += 1
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        _diffusiondb_parts(root, mapping)
        metrics = diffusiondb.filter_diffusiondb(root, root / "filtered.parquet", FilterRules(), LIMITS)
    assert metrics["rows_out"] >= 1  # good.png of part 2
    assert metrics["rows_in"] == metrics["rows_out"] + sum(v for k, v in metrics.items() if k.startswith("dropped_"))


@FILE_CHECKS
@given(document=hostile_json())
def test_a_hostile_coco_file_is_rows_or_an_error_naming_the_file(document, memory_ceiling):
    RAN["test_a_hostile_coco_file_is_rows_or_an_error_naming_the_file"] += 1
    with _file_holding("instances_val2017.json", document) as path:
        try:
            coco._load(path, LIMITS)
        except InputError as err:
            assert str(path) in str(err)


IMAGES = st.sampled_from([GOOD_PNG, GOOD_PNG[:60], b"", b"\x89PNG\r\n\x1a\n" + bytes(40)]) | st.binary(max_size=300)


@CHECKS
@given(txt=st.binary(max_size=2_000) | st.just(b"a" * 100_000), meta=hostile_json(), image=IMAGES)
def test_an_encode_sample_with_hostile_members_is_encoded_or_counted(txt, meta, image, memory_ceiling):
    RAN["test_an_encode_sample_with_hostile_members_is_encoded_or_counted"] += 1
    out = decode_sample("k", {"txt": txt, "json": meta, "png": image}, [(32, 32)], "resize", 89_478_485, 4096)
    assert out.problem in (None, "no_image", "corrupt", "too_large", "wrong_size")
    assert len(out.caption) <= 4096 and (out.image is None) == (out.problem is not None)


@CHECKS
@given(cut=st.integers(0, 10_000), flips=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), max_size=8))
def test_a_mangled_shard_yields_its_readable_samples_and_counts_the_damage(cut, flips, memory_ceiling):
    RAN["test_a_mangled_shard_yields_its_readable_samples_and_counts_the_damage"] += 1
    good = [{"__key__": f"{i:04d}", "png": GOOD_PNG, "txt": "a red square"} for i in range(3)]
    data = bytearray(tar_bytes(good))
    for at, value in flips:
        data[at % len(data)] = value
    counts: Counter = Counter()
    samples = list(iter_tar_groups(io.BytesIO(bytes(data[: len(data) - cut % len(data)])), counts, 4096, 89_478_485))
    assert len(samples) <= 3 and set(counts) <= {"tar_errors", "skipped_duplicate_key"}
    if not flips and cut == 0:
        assert [k for k, _ in samples] == ["0000", "0001", "0002"]


@CHECKS
@given(data=st.binary(max_size=400) | st.sampled_from([GOOD_PNG, GOOD_PNG[:80]]))
@example(data=b"")  # found by this test: cv2.imdecode raised on an empty buffer
def test_the_recaption_decoder_answers_an_image_or_a_counted_reason(data, memory_ceiling):
    RAN["test_the_recaption_decoder_answers_an_image_or_a_counted_reason"] += 1
    image, reason = _decode(data, 89_478_485)
    assert (image is None) == (reason is not None) and reason in (None, TOO_LARGE, UNREADABLE)


@CHECKS
@given(data=st.binary(max_size=300_000), limit=st.integers(77, 5_000))
def test_a_caption_of_any_bytes_is_cut_to_its_bound(data, limit, memory_ceiling):
    RAN["test_a_caption_of_any_bytes_is_cut_to_its_bound"] += 1
    text, cut = decode_caption(data, limit)
    assert len(text) <= limit and cut == (len(data.decode("utf-8", errors="replace")) > limit)


@st.composite
def hostile_yaml(draw) -> str:
    kind = draw(st.sampled_from(["aliases", "deep", "random", "mistyped"]))
    if kind == "aliases":
        return alias_bomb(draw(st.integers(3, 12)))
    if kind == "deep":
        depth = draw(st.integers(10, 2_000))
        return "a: " + "[" * depth + "]" * draw(st.sampled_from([0, depth]))
    if kind == "random":
        return draw(st.text(max_size=300))
    return json.dumps({"paths": draw(values), "phases": draw(values), "sources": draw(values)})


@FILE_CHECKS
@given(text=hostile_yaml())
@example(text="\x1f")  # found by this test: the YAML reader raised outside the ConfigError net
def test_a_hostile_params_file_is_a_mapping_or_a_config_error(text, memory_ceiling):
    RAN["test_a_hostile_params_file_is_a_mapping_or_a_config_error"] += 1
    with _file_holding("params.yaml", text.encode()) as path:
        try:
            read_yaml_bounded(path)
        except ConfigError as err:
            assert "params.yaml" in str(err)
