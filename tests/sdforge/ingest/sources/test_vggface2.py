"""VGGFace2: identity folders + identity_meta.csv, template captions, with configs/full/params.yaml's patterns."""

from __future__ import annotations

import pytest

from sdforge.config import ConfigError, FaceOptions, parse_params
from sdforge.ingest.image_convert import resized_size
from sdforge.ingest.sources.vggface2 import read_identity_meta, template_index
from tests.fixtures.sources import (
    BLUE,
    GREEN,
    RED,
    centre_colour,
    close_to,
    full_source,
    image_bytes,
    run_source,
    samples_by_member,
    write_vggface2,
)

TEMPLATES = FaceOptions().templates


def test_vggface2_end_to_end_template_captions(tmp_path):
    repo = tmp_path / "repo"
    write_vggface2(
        repo,
        {
            "n000001/0001_01.jpg": image_bytes(40, 48, RED),
            "n000001/0002_01.jpg": image_bytes(48, 40, GREEN),
            "n000001/0003_01.jpg": image_bytes(20, 20),  # below filter.min_width/min_height
            "n000002/0001_01.jpg": image_bytes(40, 40, BLUE),
            "n000002/0002_01.jpg": b"",  # zero bytes: the header read fails
            "n000003/0001_01.jpg": image_bytes(40, 40, BLUE),  # identity missing from the CSV
        },
        [("n000001", "Aaron_Eckhart", "m"), ("n000002", "Abbie_Cornish", "f")],
    )
    source = full_source("vggface2", repo, filter={"min_width": 32, "min_height": 32})
    filtered, fetched, out = run_source(source, "vggface2", tmp_path / "work")
    assert filtered == {
        "files": 6,
        "rows_in": 6,
        "dropped_unsafe_member": 0,
        "dropped_duplicate": 0,
        "dropped_unreadable": 1,
        "dropped_too_small": 1,
        "rows_out": 4,
        "rows_unknown_gender": 1,
        "captions_truncated": 0,
    }
    assert (fetched["samples"], fetched["successes"]) == (4, 4)
    samples = samples_by_member(out)
    expected = {
        "train/n000001/0001_01.jpg": ("man", "Aaron_Eckhart", RED),
        "train/n000001/0002_01.jpg": ("man", "Aaron_Eckhart", GREEN),
        "train/n000002/0001_01.jpg": ("woman", "Abbie_Cornish", BLUE),
        "train/n000003/0001_01.jpg": ("person", None, BLUE),
    }
    assert sorted(samples) == sorted(expected)
    for member, (word, name, colour) in expected.items():
        sample = samples[member]
        index = template_index(member, len(TEMPLATES))
        assert sample["txt"] == TEMPLATES[index].format(gender=word)
        assert (sample["json"]["template"], sample["json"]["name"]) == (index, name)
        meta = sample["json"]  # the full config fetches keep_ratio: shorter side 32, aspect kept
        kept = resized_size(meta["original_width"], meta["original_height"], 32, "keep_ratio")
        assert (meta["width"], meta["height"]) == kept and min(kept) == 32
        assert close_to(centre_colour(sample["jpg"]), colour)
    assert samples["train/n000001/0001_01.jpg"]["txt"] == "a headshot of a man, detailed face"  # pinned: stable hash
    assert samples["train/n000002/0001_01.jpg"]["json"]["identity"] == "n000002"


def test_template_choice_is_stable_and_spread():
    assert template_index("train/n000001/0001_01.jpg", 3) == 2  # SHA-256, not Python's salted hash()
    counts = [0, 0, 0]
    for i in range(300):
        counts[template_index(f"train/n{i:06d}/{i:04d}_01.jpg", 3)] += 1
    assert min(counts) > 70


def test_identity_meta_with_leading_spaces_and_quoted_names(tmp_path):
    path = tmp_path / "identity_meta.csv"
    path.write_text(
        'Class_ID, Name, Sample_Num, Flag, Gender\nn000001, "Doe, Jane", 424, 0, f\nn000009, "X", 1, 1, m\n'
    )
    assert read_identity_meta(path) == {
        "n000001": {"name": "Doe, Jane", "gender": "f"},
        "n000009": {"name": "X", "gender": "m"},
    }


def test_templates_allow_only_the_gender_placeholder():
    with pytest.raises(ValueError, match=r"the only placeholder is \{gender\}; got \['name'\]"):
        FaceOptions(templates=["a photo of {name}"])
    with pytest.raises(ConfigError, match=r"sources\.v\.vggface2\.templates: .*template '\{'"):
        parse_params({"sources": {"v": {"kind": "vggface2", "repo": "x", "vggface2": {"templates": ["{"]}}}})
