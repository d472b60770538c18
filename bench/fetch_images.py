"""Benchmark: the ``fetch_images`` stage (LAION kind, SSRF guard on) vs bare ``img2dataset.download``.

``python -m bench.fetch_images`` (4,000 images) or ``--quick`` (500). A corpus of small JPEGs
(64–256 px a side, random sizes and contents, seeded) is generated once and cached under
``data/bench/fetch_images/`` (git-ignored), then served by a threaded loopback HTTP server
(``sdforge.demo.http_server.serve_directory``) in this process. Each implementation then runs in a fresh
subprocess, same processes/threads/image size/shard size:

* ours: ``fetch_images.run(...)`` with ``allow_networks: ["127.0.0.0/8"]`` — fingerprint, guarded
  img2dataset (:mod:`sdforge.ingest.url_guard` in every worker), canonicalisation, metrics;
* bare: ``img2dataset.download(...)`` with the same arguments (no guard, no canonicalisation).

Both must fetch every image. Times are the work inside each child (interpreter start-up and imports
excluded, both printed; img2dataset's worker start-up is part of both); CPU seconds are the child's
and its reaped workers'. The pair runs ``--rounds`` times (3; ``--quick`` 1), the order alternating,
and the medians are compared, since a shared machine's load drifts. Throughput is images per second;
the last line is ``RESULT name=fetch_images ratio=<ours/bare> ...``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import shutil
import statistics
import sys
import time
from pathlib import Path

from bench._common import BENCH_DATA, machine, python_module, result_line, run_measured
from sdforge.config import FetchSettings, Source
from sdforge.demo.http_server import serve_directory
from sdforge.ingest import url_guard  # noqa: F401 (imported before the clock starts, as img2dataset)
from stages import fetch_images

SEED = 20240607
FULL, QUICK = 4000, 500


def corpus(images: int) -> Path:
    """The cached folder of ``images`` JPEGs ``00000.jpg`` ... (generated on first use)."""
    import cv2
    import numpy as np

    root = BENCH_DATA / "fetch_images" / f"images-{images}"
    if (root / "COMPLETE").exists():
        return root / "www"
    shutil.rmtree(root, ignore_errors=True)
    (root / "www").mkdir(parents=True)
    rng = np.random.default_rng(SEED)
    start = time.perf_counter()
    for i in range(images):
        h, w = rng.integers(64, 257, 2)
        small = rng.integers(0, 256, (h // 8 + 1, w // 8 + 1, 3), dtype=np.uint8)  # blocky, photo-like sizes
        img = cv2.resize(small, (int(w), int(h)), interpolation=cv2.INTER_LINEAR)
        cv2.imwrite(str(root / "www" / f"{i:05d}.jpg"), img, [cv2.IMWRITE_JPEG_QUALITY, 90])
    (root / "COMPLETE").write_text(f"{images}\n")
    print(f"generated {images} JPEGs in {time.perf_counter() - start:.1f}s under {root}", flush=True)
    return root / "www"


def child(kind: str, spec: dict) -> None:
    """Run one implementation; print one JSON line: seconds, successes, samples, import seconds."""
    t0 = time.perf_counter()
    os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")
    from img2dataset import download

    imported = time.perf_counter() - t0
    work = Path(spec["work"])
    out = work / f"out-{kind}"
    shutil.rmtree(out, ignore_errors=True)
    start = time.perf_counter()
    if kind == "ours":
        fetch = FetchSettings(
            image_size=spec["image_size"],
            processes=spec["processes"],
            threads=spec["threads"],
            shard_size=spec["shard_size"],
            timeout=30,
            allow_networks=["127.0.0.0/8"],
        )
        metrics = fetch_images.run(Source(kind="laion", repo="unused", fetch=fetch), "bench", work, work, out)
        successes, samples = metrics["successes"], metrics["samples"]
    else:
        download(
            url_list=str(work / "filtered.parquet"),
            input_format="parquet",
            url_col="url",
            caption_col="caption",
            output_format="webdataset",
            output_folder=str(out),
            image_size=spec["image_size"],
            resize_mode="center_crop",
            processes_count=spec["processes"],
            thread_count=spec["threads"],
            timeout=30,
            number_sample_per_shard=spec["shard_size"],
            enable_wandb=False,
        )
        stats = [json.loads(p.read_text()) for p in out.glob("*_stats.json")]
        successes, samples = sum(s["successes"] for s in stats), sum(s["count"] for s in stats)
    seconds = time.perf_counter() - start
    cpu = sum(
        getattr(resource.getrusage(who), field)
        for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
        for field in ("ru_utime", "ru_stime")
    )
    print(
        json.dumps({"seconds": seconds, "cpu_s": cpu, "successes": successes, "samples": samples, "import_s": imported})
    )


def measure(kind: str, spec: dict, hits: collections.Counter[str], images: int) -> dict:
    """One child run of ``kind``: its JSON result plus requests seen, wall time and peak RSS."""
    before = sum(hits.values())
    m = run_measured(
        python_module("bench.fetch_images", "--child", kind, "--spec", json.dumps(spec)),
        env={**os.environ, "NO_ALBUMENTATIONS_UPDATE": "1"},
        cwd=Path(__file__).resolve().parents[1],
    )
    if m.returncode != 0:
        raise SystemExit(f"{kind} failed with status {m.returncode}")
    res = json.loads(m.stdout.strip().splitlines()[-1])
    if res["successes"] != images or res["samples"] != images:
        raise SystemExit(f"{kind} fetched {res['successes']}/{res['samples']} of {images} images")
    return res | {"requests": sum(hits.values()) - before, "wall_s": m.wall_s, "peak_rss_mb": m.peak_rss_mb}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.fetch_images", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"{QUICK} images instead of {FULL}, one round")
    parser.add_argument("--images", type=int, help="corpus size (overrides --quick)")
    parser.add_argument("--rounds", type=int, help="ours/bare pairs, order alternating (default 3; --quick 1)")
    parser.add_argument("--processes", type=int, default=min(4, len(os.sched_getaffinity(0))))
    parser.add_argument("--threads", type=int, default=16)
    parser.add_argument("--image-size", type=int, default=512, help="output size, center crop (the stage default)")
    parser.add_argument("--shard-size", type=int, default=250)
    parser.add_argument("--child", choices=["ours", "bare"], help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child, json.loads(args.spec))
        return

    import polars as pl

    images = args.images or (QUICK if args.quick else FULL)
    rounds = args.rounds or (1 if args.quick else 3)
    www = corpus(images)
    work = BENCH_DATA / "fetch_images" / "work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    hits: collections.Counter[str] = collections.Counter()
    runs: dict[str, list[dict]] = {"ours": [], "bare": []}
    spec = {
        "work": str(work),
        "processes": args.processes,
        "threads": args.threads,
        "image_size": args.image_size,
        "shard_size": args.shard_size,
    }
    with serve_directory(www, 0, hits=hits) as base:
        names = sorted(p.name for p in www.glob("*.jpg"))
        pl.DataFrame({"url": [f"{base}/{n}" for n in names], "caption": [f"image {n}" for n in names]}).write_parquet(
            work / "filtered.parquet"
        )
        for r in range(rounds):
            for kind in ("ours", "bare") if r % 2 == 0 else ("bare", "ours"):
                res = measure(kind, spec, hits, images)
                runs[kind].append(res)
                print(
                    f"round {r + 1} {kind:>4}: {res['seconds']:.2f} s, {images / res['seconds']:.1f} images/s, "
                    f"{1000 * res['cpu_s'] / images:.2f} ms CPU/image ({res['requests']} requests; "
                    f"child wall {res['wall_s']:.1f} s incl. {res['import_s']:.1f} s imports; "
                    f"peak RSS {res['peak_rss_mb']:.0f} MiB)",
                    flush=True,
                )
    shutil.rmtree(work, ignore_errors=True)
    where = machine()
    print(f"machine: {where}")
    print(
        f"corpus: {images} JPEGs 64-256 px on loopback; {args.processes} processes x {args.threads} threads, "
        f"{args.image_size} px center crop, shards of {args.shard_size}; {rounds} round(s), medians"
    )
    rate = {kind: statistics.median(images / res["seconds"] for res in rs) for kind, rs in runs.items()}
    cpu = {kind: statistics.median(res["cpu_s"] for res in rs) for kind, rs in runs.items()}
    for kind in runs:
        print(f"{kind:>4}: {rate[kind]:.1f} images/s, {1000 * cpu[kind] / images:.2f} ms CPU/image")
    ratio = rate["ours"] / rate["bare"]
    print(f"ours/bare throughput: {ratio:.3f} (goal >= 0.95); CPU per image ours/bare: {cpu['ours'] / cpu['bare']:.3f}")
    print(
        result_line(
            "fetch_images", ratio, ours_img_s=rate["ours"], bare_img_s=rate["bare"], images=images, machine=where
        )
    )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
