"""Captions bounded at the door (issue 39, case 2): 20, 60 and 100 MB captions are cut to
``fetch.max_caption_chars`` where they enter (filter: flagged and counted) and wherever a stage reads one (encode,
recaption) before a tokenizer sees them; the samples beside them are kept. On main before the fix a 60 MB caption
made ``encode_latents`` abort in the Rust tokenizer (SIGABRT, 7-8 GiB) and a 20 MB one cost it 5.6 GiB."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import polars as pl
import pyarrow.parquet as pq
import pytest

from model.builders import build_tiny_vae
from sdforge.bounds.captions import cut_caption, decode_caption, read_caption_file
from sdforge.captions.shards import Captioning, caption_shards
from sdforge.config import FilterRules, LocalOptions
from sdforge.demo.models import write_demo_tokenizer
from sdforge.ingest.shards import tar_bytes
from sdforge.ingest.sources.local import filter_local
from sdforge.latents import store
from sdforge.latents.inputs import decode_chunk, iter_tar_members, member_bounds
from tests.fixtures.sources import RED, image_bytes

REPO = Path(__file__).resolve().parents[3]
LIMIT = 4096  # fetch.max_caption_chars' default
MB = 1_000_000


def test_cut_caption_keeps_short_text_and_cuts_long_text_to_the_limit():
    assert cut_caption("a red square", LIMIT) == ("a red square", False)
    assert cut_caption("x" * (LIMIT + 1), LIMIT) == ("x" * LIMIT, True)
    assert cut_caption("x" * (LIMIT + 1), None) == ("x" * (LIMIT + 1), False)


@pytest.mark.parametrize("size", [20 * MB, 60 * MB, 100 * MB])
def test_decode_caption_decodes_only_what_the_limit_can_use(size):
    text, cut = decode_caption(b"\xc3\xa9" * (size // 2), LIMIT)  # "é", 2 bytes each
    assert (text, cut) == ("é" * LIMIT, True)


def test_read_caption_file_reads_a_few_kib_of_a_100_mb_file_and_drops_a_split_character(tmp_path):
    path = tmp_path / "a.txt"
    path.write_bytes(b"ab" + "€".encode() * (50 * MB))  # 3-byte characters: the read limit splits one
    text, cut = read_caption_file(path, LIMIT)
    assert cut and text == "ab" + "€" * (LIMIT - 2)
    small = tmp_path / "b.txt"
    small.write_text("a red square", encoding="utf-8")
    assert read_caption_file(small, LIMIT) == ("a red square", False)
    bad = tmp_path / "c.txt"
    bad.write_bytes(b"\xff" + b"a" * (10 * LIMIT))  # invalid UTF-8 inside the read part: still an error
    with pytest.raises(UnicodeDecodeError):
        read_caption_file(bad, LIMIT)


def test_a_100_mb_txt_beside_a_local_image_is_read_cut_flagged_and_counted(tmp_path):
    meta, out = tmp_path / "meta", tmp_path / "filtered.parquet"
    meta.mkdir()
    for name in ("big", "good"):
        (meta / f"{name}.png").write_bytes(image_bytes(40, 40, RED, "PNG"))
    (meta / "big.txt").write_bytes(b"a red square " * (100 * MB // 13))
    (meta / "good.txt").write_text("a red square", encoding="utf-8")
    metrics = filter_local(meta, out, LocalOptions(), FilterRules(), max_caption_chars=LIMIT)
    rows = pl.read_parquet(out)
    assert (metrics["rows_out"], metrics["captions_truncated"]) == (2, 1)
    assert rows.select("member", "caption_truncated").rows() == [("big.png", True), ("good.png", False)]
    assert [len(c) for c in rows["caption"]] == [LIMIT, len("a red square")]


@pytest.mark.parametrize("size", [20 * MB, 60 * MB, 100 * MB])
def test_encode_cuts_a_huge_caption_before_tokenizing_and_keeps_the_samples_beside_it(size):
    chunk = [("000000000", {"png": image_bytes(40, 40, RED, "PNG"), "txt": b"a" * size}),
             ("000000001", {"png": image_bytes(40, 40, RED, "PNG"), "txt": b"a red square"})]  # fmt: skip
    out = decode_chunk(chunk, [(32, 32)], "resize", {"000000001": "b" * (LIMIT + 5)}, None, LIMIT)
    assert [(len(s.caption), s.caption_cut, s.problem) for s in out] == [(LIMIT, True, None), (12, True, None)]
    assert out[1].synthetic == "b" * LIMIT


ENCODE_IN_A_FRESH_PROCESS = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    from sdforge.config import Encode
    from stages import encode_latents
    shards, models, out = (Path(a) for a in sys.argv[1:4])
    cfg = Encode(batch_size=4, device="cpu", resolution=32, decode_workers=2, mixed_precision="no")
    metrics = encode_latents.run(cfg, "local", shards, models, out, max_caption_chars=int(sys.argv[4]))
    # VmHWM, not ru_maxrss: Linux carries ru_maxrss over exec, so a child of a big pytest process starts at its
    # parent's peak; VmHWM is the new process image's own high-water mark
    hwm = next(line for line in open("/proc/self/status") if line.startswith("VmHWM:"))
    print(json.dumps({**metrics, "peak_rss_mib": int(hwm.split()[1]) / 1024}))
    """
)


def test_a_100_mb_caption_in_a_shard_encodes_under_1_gib_and_keeps_every_sample(tmp_path):
    """The whole stage in its own process, so its peak RSS is its own: on main it aborted (SIGABRT, rc 134)."""
    models, shards = tmp_path / "models", tmp_path / "shards"
    vae = build_tiny_vae([8, 16], 1, 4, seed=0)
    vae.save_pretrained(models / "vae", safe_serialization=True)
    write_demo_tokenizer(["a", "red", "square"], models / "tokenizer", 77)
    shards.mkdir()
    samples = [{"__key__": f"{i:09d}", "png": image_bytes(32, 32, RED, "PNG"), "txt": "a red square"} for i in range(3)]
    samples[1]["txt"] = b"a red square " * (100 * MB // 13)
    (shards / "00000.tar").write_bytes(tar_bytes(samples))
    done = subprocess.run(
        [sys.executable, "-c", ENCODE_IN_A_FRESH_PROCESS, str(shards), str(models), str(tmp_path / "out"), str(LIMIT)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    metrics = json.loads(done.stdout.strip().splitlines()[-1])
    assert (metrics["samples"], metrics["captions_cut"], metrics["captions_truncated"]) == (3, 1, 1)
    print(f"peak RSS {metrics['peak_rss_mib']:.0f} MiB")
    assert metrics["peak_rss_mib"] < 1024, f"peak RSS {metrics['peak_rss_mib']:.0f} MiB"
    manifest = pl.read_parquet(tmp_path / "out" / store.MANIFEST)
    assert sorted(len(c) for c in manifest["caption"]) == [12, 12, LIMIT]


def test_caption_images_reads_a_huge_original_caption_cut_and_captions_every_image(tmp_path):
    shards, out = tmp_path / "shards", tmp_path / "captions"
    shards.mkdir()
    samples = [{"__key__": f"{i:09d}", "png": image_bytes(40, 40, RED, "PNG"), "txt": f"image {i}"} for i in range(2)]
    samples[0]["txt"] = b"x" * (60 * MB)
    (shards / "00000.tar").write_bytes(tar_bytes(samples))
    seen = []

    def count_tokens(text):
        seen.append(len(text))
        return 3

    def generate(images):
        return [" ".join(f"w{i}" for i in range(3000))] * len(images)  # 15,889 characters: cut to the limit too

    run = Captioning("scripted", None, "fp", "a photo of", generate, count_tokens, max_caption_chars=LIMIT)
    stats = caption_shards(shards, out, run)
    rows = pq.read_table(out / "00000.parquet").to_pylist()
    assert stats.images == 2 and max(seen) <= LIMIT
    assert [len(r["original_caption"]) for r in rows] == [LIMIT, len("image 1")]
    assert [len(r["synthetic_caption"]) for r in rows] == [LIMIT, LIMIT]


def test_a_tar_reader_keeps_only_the_start_of_a_huge_txt_member_and_reads_the_next_member_whole():
    samples = [{"__key__": "0", "txt": b"a" * (20 * MB), "json": b"{}"}, {"__key__": "1", "txt": b"a red square"}]
    reader = io.BytesIO(tar_bytes(samples))
    members = list(iter_tar_members(reader, member_bounds(LIMIT)))
    assert sorted((n, len(d)) for n, d in members) == [("0.json", 2), ("0.txt", 4 * LIMIT + 1), ("1.txt", 12)]
