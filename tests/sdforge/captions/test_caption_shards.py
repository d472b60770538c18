"""Captioning WebDataset shards: content cache across runs, a prompt change, a kill mid-run, bad images and
degenerate generations — with a scripted captioner (counts every image it is asked for) and with a tiny BLIP."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from sdforge.captions.cache import settings_fingerprint
from sdforge.captions.captioner import generate, load_captioner
from sdforge.captions.shards import UNREADABLE, Captioning, caption_shards, remove_orphans
from tests.fixtures.captioner import COLOURS, build_tiny_blip, jpeg, tar_bytes, write_shard


class Scripted:
    """Names the dominant colour; records how many images it was asked for; can fail at a call or misbehave."""

    def __init__(self, fail_at_call: int | None = None, degenerate: bool = False):
        self.asked, self.calls, self.fail_at_call, self.degenerate = 0, 0, fail_at_call, degenerate

    def __call__(self, images):
        self.calls += 1
        if self.calls == self.fail_at_call:
            raise KeyboardInterrupt("killed")
        self.asked += len(images)
        names = [list(COLOURS)[int(np.argmax(img.reshape(-1, 3).mean(0)))] for img in images]
        if self.degenerate:
            return ["", "a photo of", "square square square square square square"][: len(images)] + [
                f"a {n} square" for n in names[3:]
            ]
        return [f"a {n} square on a plain background" for n in names]


def run_with(model: Scripted, prompt: str = "a photo of", batch: int = 4) -> Captioning:
    fp = settings_fingerprint("scripted", "r1", prompt, {"max_new_tokens": 20})
    return Captioning("scripted", "r1", fp, prompt, model, lambda t: len(t.split()) + 2, batch_size=batch)


def test_a_new_shard_is_the_only_one_captioned_and_a_prompt_change_recaptions_all(tmp_path):
    shards, out = tmp_path / "shards", tmp_path / "captions"
    write_shard(shards, 0, 6, corrupt=2)
    write_shard(shards, 1, 5)
    first = Scripted()
    stats = caption_shards(shards, out, run_with(first))
    assert (stats.shards_done, stats.images, stats.captioned, first.asked) == (2, 11, 10, 10)
    assert stats.rejected[UNREADABLE] == 1
    rows = pq.read_table(out / "00000.parquet").to_pylist()
    assert len(rows) == 6 and rows[2]["rejected"] == UNREADABLE and rows[2]["synthetic_caption"] == "IMG_0_2.jpg"
    assert (
        rows[0]["synthetic_caption"] == "a red square on a plain background"
        and rows[0]["original_caption"] == "IMG_0_0.jpg"
    )
    write_shard(shards, 2, 4)
    again = Scripted()
    stats = caption_shards(shards, out, run_with(again))
    assert (stats.shards_skipped, stats.shards_done, again.asked) == (2, 1, 4)  # only the new shard's images
    changed = Scripted()
    stats = caption_shards(shards, out, run_with(changed, prompt="describe the image"))
    assert (stats.shards_done, changed.asked, stats.stale) == (3, 14, 14)  # everything, and said so


def test_a_kill_mid_run_resumes_at_the_first_unfinished_shard(tmp_path):
    shards, out = tmp_path / "shards", tmp_path / "captions"
    for shard in range(3):
        write_shard(shards, shard, 4)
    with pytest.raises(KeyboardInterrupt):
        caption_shards(shards, out, run_with(Scripted(fail_at_call=2), batch=4))  # dies in shard 1
    assert sorted(p.name for p in out.iterdir()) == ["00000.parquet"]  # no torn parquet
    resumed = Scripted()
    stats = caption_shards(shards, out, run_with(resumed, batch=4))
    assert (stats.shards_skipped, stats.shards_done, resumed.asked) == (1, 2, 8)


def test_degenerate_generations_are_counted_and_fall_back(tmp_path):
    shards, out = tmp_path / "shards", tmp_path / "captions"
    write_shard(shards, 0, 5)
    stats = caption_shards(shards, out, run_with(Scripted(degenerate=True), batch=5))
    metrics = stats.as_metrics()
    assert (metrics["rejected_empty"], metrics["rejected_prompt_echo"], metrics["rejected_repetition"]) == (1, 1, 1)
    assert metrics["rejected"] == 3 and metrics["captioned"] == 5
    rows = pq.read_table(out / "00000.parquet").to_pylist()
    assert [r["synthetic_caption"] for r in rows[:3]] == ["IMG_0_0.jpg", "IMG_0_1.jpg", "IMG_0_2.jpg"]
    assert rows[3]["synthetic_caption"] == "a red square" and rows[3]["rejected"] is None


def test_the_real_captioner_through_the_shards(tmp_path):
    """The tiny BLIP behind the same function: every image gets a row, its settings and a verdict."""
    processor, model = load_captioner(str(build_tiny_blip(tmp_path / "blip")))
    shards, out = tmp_path / "shards", tmp_path / "captions"
    write_shard(shards, 0, 4)
    fp = settings_fingerprint("tiny-blip", None, "a photo of", {"max_new_tokens": 8})
    bound = partial(generate, processor, model, prompt="a photo of", settings={"max_new_tokens": 8})
    run = Captioning("tiny-blip", None, fp, "a photo of", bound, lambda t: len(t.split()) + 2, batch_size=2)
    stats = caption_shards(shards, out, run)
    rows = pq.read_table(out / "00000.parquet").to_pylist()
    assert stats.captioned == 4 and len(rows) == 4 and {r["settings"] for r in rows} == {fp}
    assert all(r["synthetic_caption"] == (r["original_caption"] if r["rejected"] else r["generated"]) for r in rows)


def test_a_refetched_shard_is_captioned_again_and_a_gone_one_removed(tmp_path):
    shards, out = tmp_path / "shards", tmp_path / "captions"
    write_shard(shards, 0, 3)
    write_shard(shards, 1, 3)
    caption_shards(shards, out, run_with(Scripted()))
    write_shard(shards, 0, 4)  # fetch_images wrote shard 0 again: its 3 images and a new one
    (shards / "00001.tar").unlink()
    again = Scripted()
    stats = caption_shards(shards, out, run_with(again))
    # the shard is redone, but by content only the new image is captioned
    assert (stats.shards_done, stats.shards_removed, stats.cached, again.asked) == (1, 1, 3, 1)
    assert pq.read_table(out / "00000.parquet").num_rows == 4
    assert sorted(p.name for p in out.glob("*.parquet")) == ["00000.parquet"]


@pytest.mark.parametrize("degenerate", [False, True])
def test_samples_with_the_same_image_bytes_keep_their_own_original_captions(tmp_path, degenerate):
    """Issue 39, case 8: the content cache shares the generation (it belongs to the image), never the caption
    (it belongs to the sample) — also when the generation is rejected and the original is used instead."""
    shards, out = tmp_path / "shards", tmp_path / "captions"
    same = jpeg(COLOURS["red"], 7)
    samples = [{"__key__": f"0000000{i}", "jpg": same, "txt": text} for i, text in enumerate(["first", "second"])]
    shards.mkdir()
    (shards / "00000.tar").write_bytes(tar_bytes(samples))
    model = Scripted(degenerate=degenerate)
    caption_shards(shards, out, run_with(model))
    rows = pq.read_table(out / "00000.parquet").to_pylist()
    assert model.asked == 1  # one image, captioned once
    assert [r["original_caption"] for r in rows] == ["first", "second"]
    expected = ["first", "second"] if degenerate else ["a red square on a plain background"] * 2
    assert [r["synthetic_caption"] for r in rows] == expected


def test_remove_orphans_deletes_only_temps_and_parquets_without_a_tar(tmp_path):
    """What ``caption_images`` deletes in its output folder: a killed run's ``.*.tmp`` and the captions of a shard
    that is gone; the captions of a shard that is there and anything else stay."""
    out = tmp_path / "captions"
    out.mkdir()
    for name in ("00000.parquet", "00001.parquet", ".00002.parquet.tmp", "notes.txt"):
        (out / name).write_bytes(b"x")
    assert remove_orphans(out, [Path("shards/00000.tar")]) == 1
    assert sorted(p.name for p in out.iterdir()) == ["00000.parquet", "notes.txt"]
