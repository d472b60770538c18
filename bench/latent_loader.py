"""Benchmark: the training loader over the memory-mapped latent store vs one ``.npy`` per sample loaded into RAM.

``python -m bench.latent_loader`` (100k samples in 8 aspect-ratio buckets of SD-like latents, about
4×64×64 fp16 each, ≈3.3 GB per design on disk) or ``--quick`` (10k); ``--buckets N`` (1–8; 1 = the
square-only store of before issue 18). Issue 18's acceptance: with 8 buckets the loader keeps ≥ 100
batches/s cold at 100k samples. The data are generated once and cached under
``data/bench/latent_loader/v<LAYOUT>-b<N>/<n>/`` (git-ignored; ``SDFORGE_BENCH_DATA`` moves it; a new
:data:`LAYOUT` regenerates it; ``--clean`` deletes it after the run):

- ``store/bench/px512/shard-NNNNN-WxH.safetensors``: input shard NNNNN (4096 consecutive samples) holds
  one file per bucket (:func:`sdforge.latents.store.write_shard`), like ``encode_latents`` writes them;
  the bucket of each sample is drawn with weight 1/(k+1) over :data:`BUCKETS` (square first, rarer
  shapes after, as in LAION); ``manifest.parquet`` (``source, shard, bucket_width, bucket_height, row,
  key``) and ``mix.parquet``, a phase index over all samples built by :func:`stages.mix_phase.build_index`
  (so in shuffled order, like a real phase index);
- ``npy/NNN/NNNNNNN.npy``, the same latents one file per sample, plus ``npy/input_ids.npy``.

Each design runs in a fresh subprocess, ours first, after every file of *both* designs has been
dropped from the page cache (``fdatasync`` was done at generation; ``posix_fadvise(DONTNEED)`` per
file, which needs no root) — the parent checks with ``mincore(2)`` that almost none of either
design's pages are resident before each run and prints the fraction. In each child:

- ours: ``LatentIndexDataset(mix.parquet, store, "px512")``, ``rank_batches`` (one bucket per batch with
  several buckets; the strided permutation with one), then ``iter_batches`` over that shuffled epoch;
- reference: the index's files loaded by ``ThreadPoolExecutor(16)`` + ``np.load`` into one
  preallocated fp16 array per bucket (the token ids from one ``.npy``), then the same ``rank_batches``
  batches gathered from RAM and converted exactly as the trainer receives them (with the loader's own
  :func:`~sdforge.latents.loader.to_float32`, so only the design differs).

Start-up is the seconds from constructing the loader to holding the first batch (imports excluded;
printed apart). Batches/s is over the whole epoch of batches of 24 after the first. Anonymous
(private) RSS is the peak of ``RssAnon`` from ``/proc/self/status`` sampled every 20 ms; peak RSS is
the child's ``VmHWM`` (file-backed page-cache pages of the memmaps included). Not ``wait4``'s
``ru_maxrss``: Linux carries the parent's high-water mark over ``exec`` into it. The last
line is ``RESULT name=latent_loader ratio=<reference start-up / ours> ... batches_per_s=<ours, cold>
buckets=<N>``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import shutil
import sys
import threading
import time
from pathlib import Path

import numpy as np
import polars as pl

from bench._common import BENCH_DATA, load_average, machine, python_module, result_line, run_measured
from sdforge.config import Phase
from sdforge.latents.bucket_batches import BatchSplit
from sdforge.latents.loader import LatentIndexDataset, iter_batches, rank_batches, to_float32
from sdforge.latents.store import MANIFEST, resolution_dir, shard_path, write_shard
from stages.mix_phase import build_index

LAYOUT = 2
"""Version of the generated files' layout (2: one file per input shard and bucket); a change regenerates."""
BUCKETS = [(512, 512), (448, 576), (576, 448), (384, 640), (640, 384), (416, 608), (608, 416), (704, 352)]
"""Bucket shapes (width, height) in pixels, most frequent first: SD 512² shapes (sides multiples of 32, area
≤ 512², aspect 1:2–2:1, from ``generate_buckets(512 * 512, 32, 0.5, 2.0)``); latents are 4 × H/8 × W/8
(h×w 64×64, 72×56, 56×72, 80×48, 48×80, 76×52, 52×76, 44×88: 3840–4096 latent pixels, 94–100 % of 64×64)."""
LATENT_CHANNELS, FACTOR = 4, 8
RESOLUTION = "px512"
SHARD_ROWS = 4096
BATCH = 24
THREADS = 16
SOURCE = "bench"
SEED = 20240601


# ------------------------------------------------------------------------------------------ data


def latent_shape(bucket: tuple[int, int]) -> tuple[int, int, int]:
    """``(C, h, w)`` of a bucket's latents."""
    return (LATENT_CHANNELS, bucket[1] // FACTOR, bucket[0] // FACTOR)


def sample_buckets(samples: int, buckets: int) -> np.ndarray:
    """Each sample's bucket (a position in ``BUCKETS[:buckets]``), drawn with weight 1/(k+1), seeded."""
    if not 1 <= buckets <= len(BUCKETS):
        raise ValueError(f"--buckets must be 1..{len(BUCKETS)}, got {buckets}")
    weights = 1 / np.arange(1, buckets + 1)
    return np.random.default_rng(SEED).choice(buckets, size=samples, p=weights / weights.sum())


def layout(samples: int, buckets: int) -> pl.DataFrame:
    """The store's manifest: per sample (numbered in ``key``) its input shard, bucket and row in that
    (shard, bucket) file — samples of one shard and bucket in key order."""
    bucket = sample_buckets(samples, buckets)
    shard = np.arange(samples) // SHARD_ROWS
    # row = how many earlier samples share the (shard, bucket)
    group = shard * len(BUCKETS) + bucket
    order = np.argsort(group, kind="stable")
    sorted_group = group[order]
    starts = np.r_[0, np.flatnonzero(np.diff(sorted_group)) + 1]
    first = np.repeat(starts, np.diff(np.r_[starts, samples]))
    row = np.empty(samples, dtype=np.int64)
    row[order] = np.arange(samples) - first
    shapes = np.array(BUCKETS)[bucket]
    return pl.DataFrame(
        {
            "key": [f"{i:07d}" for i in range(samples)],
            "caption": ["c"] * samples,
            "source": [SOURCE] * samples,
            "shard": shard.astype(np.int64),
            "bucket_width": shapes[:, 0].astype(np.int32),
            "bucket_height": shapes[:, 1].astype(np.int32),
            "row": row,
        }
    )


def data_root(samples: int, buckets: int) -> Path:
    return BENCH_DATA / "latent_loader" / f"v{LAYOUT}-b{buckets}" / str(samples)


def store_dir(root: Path) -> Path:
    return resolution_dir(root / "store", SOURCE, RESOLUTION)


def npy_path(root: Path, i: int) -> Path:
    return root / "npy" / f"{i // 1000:03d}" / f"{i:07d}.npy"


def generate(root: Path, samples: int, buckets: int) -> None:
    """Write both designs' files for ``samples`` samples (same values) unless already complete."""
    done = root / "DONE"
    if done.is_file() and json.loads(done.read_text()).get("layout") == LAYOUT:
        return
    import torch

    if root.exists():
        shutil.rmtree(root)
    print(f"generating {samples} samples in {buckets} bucket(s) under {root} (once)", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    rng = np.random.default_rng(SEED)
    manifest = layout(samples, buckets)
    bucket_w, bucket_h = manifest["bucket_width"].to_numpy(), manifest["bucket_height"].to_numpy()
    all_ids = rng.integers(0, 49408, (samples, 77), dtype=np.int32)
    for shard, start in enumerate(range(0, samples, SHARD_ROWS)):
        stop = min(start + SHARD_ROWS, samples)
        for bucket in BUCKETS[:buckets]:
            members = start + np.flatnonzero((bucket_w[start:stop] == bucket[0]) & (bucket_h[start:stop] == bucket[1]))
            if members.size == 0:
                continue
            latents = rng.standard_normal((members.size, *latent_shape(bucket)), dtype=np.float32).astype(np.float16)
            path = shard_path(root / "store", SOURCE, RESOLUTION, shard, bucket)
            write_shard(path, torch.from_numpy(latents), torch.from_numpy(all_ids[members]))
            for j, i in enumerate(members.tolist()):
                npy = npy_path(root, i)
                npy.parent.mkdir(parents=True, exist_ok=True)
                np.save(npy, latents[j])
    np.save(root / "npy" / "input_ids.npy", all_ids)
    manifest.write_parquet(store_dir(root) / MANIFEST)
    index = build_index("bench", Phase(mix={SOURCE: 1.0}, samples=samples, lr=1.0), {SOURCE: manifest}, seed=0)
    index.write_parquet(root / "mix.parquet")
    os.sync()  # everything clean on disk, so DONTNEED can drop it
    seconds = round(time.perf_counter() - t0, 1)
    done.write_text(json.dumps({"layout": LAYOUT, "samples": samples, "buckets": buckets, "seconds": seconds}))
    print(f"generated in {seconds:.0f} s", file=sys.stderr, flush=True)


def design_files(root: Path) -> dict[str, list[Path]]:
    """Every file each design reads."""
    store = sorted(store_dir(root).glob("shard-*.safetensors")) + [root / "mix.parquet"]
    npy = sorted((root / "npy").glob("*/*.npy")) + [root / "npy" / "input_ids.npy", root / "mix.parquet"]
    return {"ours": store, "ref": npy}


# ------------------------------------------------------------------------------- page cache


def drop_cache(paths: list[Path]) -> None:
    """Evict ``paths`` from the page cache (clean pages; no root needed)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]


def resident_fraction(paths: list[Path]) -> float:
    """Fraction of the pages of ``paths`` in the page cache, by ``mincore(2)`` on a fresh mapping."""
    page = mmap.PAGESIZE
    resident = total = 0
    for path in paths:
        size = path.stat().st_size
        if size == 0:
            continue
        pages = -(-size // page)
        fd = os.open(path, os.O_RDONLY)
        try:
            addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                raise OSError(ctypes.get_errno(), f"mmap {path}")
            vec = (ctypes.c_ubyte * pages)()
            try:
                if _libc.mincore(addr, size, vec) != 0:
                    raise OSError(ctypes.get_errno(), f"mincore {path}")
            finally:
                _libc.munmap(addr, size)
        finally:
            os.close(fd)
        resident += sum(b & 1 for b in bytes(vec))
        total += pages
    return resident / max(total, 1)


def cpu_pressure() -> str:
    """The kernel's CPU pressure (share of the last 60 s some task waited for a CPU): others' load."""
    try:
        some = Path("/proc/pressure/cpu").read_text().split("\n")[0]
        return "CPU pressure " + some.split()[2].split("=")[1] + " %"
    except (OSError, IndexError):
        return "CPU pressure unknown"


# ------------------------------------------------------------------------------------ children


class AnonPeak:
    """Peak ``RssAnon`` of this process, sampled every 20 ms by a daemon thread."""

    def __init__(self):
        self.peak_kb = self._read()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    @staticmethod
    def _read() -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1])
        return 0

    def _loop(self):
        while not self._stop.wait(0.02):
            self.peak_kb = max(self.peak_kb, self._read())

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        self.peak_kb = max(self.peak_kb, self._read())
        return self.peak_kb / 1024


def child(design: str, root: Path) -> None:
    t_import = time.perf_counter()
    from concurrent.futures import ThreadPoolExecutor

    import pyarrow.dataset  # noqa: F401 - pq.read_table imports it (and pandas, ~0.5 s) on first use
    import torch

    import_s = time.perf_counter() - t_import
    anon = AnonPeak()
    anon_after_import_mb = anon.peak_kb / 1024
    t0 = time.perf_counter()
    if design == "ours":
        data = LatentIndexDataset(root / "mix.parquet", root / "store", RESOLUTION)
        batches = iter_batches(data, rank_batches(data.sample_bucket, 0, 0, 0, BatchSplit(BATCH, 1, 1)))
        n = len(data)
    else:
        index = pl.read_parquet(root / "mix.parquet")
        sample = np.array([int(k) for k in index["key"].to_list()])  # the key is the sample number
        n = len(sample)
        # bucket per position, numbered as LatentIndexDataset numbers them (sorted (width, height))
        shapes, sample_bucket = np.unique(
            np.stack([index["bucket_width"].to_numpy(), index["bucket_height"].to_numpy()]), axis=1, return_inverse=True
        )
        sample_bucket = sample_bucket.reshape(-1)
        counts = np.bincount(sample_bucket, minlength=shapes.shape[1])
        slot = np.empty(n, dtype=np.int64)  # position -> row in its bucket's array
        for b in range(shapes.shape[1]):
            slot[sample_bucket == b] = np.arange(counts[b])
        latents = [
            np.empty((int(counts[b]), *latent_shape(tuple(shapes[:, b].tolist()))), dtype=np.float16)
            for b in range(shapes.shape[1])
        ]
        input_ids = np.load(root / "npy" / "input_ids.npy")[sample]

        def load(pos: int) -> None:
            latents[sample_bucket[pos]][slot[pos]] = np.load(npy_path(root, sample[pos]))

        with ThreadPoolExecutor(THREADS) as pool:
            list(pool.map(load, range(n), chunksize=256))

        def ram_batches():
            for b, pos in enumerate(rank_batches(sample_bucket, 0, 0, 0, BatchSplit(BATCH, 1, 1))):
                bucket = sample_bucket[pos[0]]
                yield b, to_float32(latents[bucket][slot[pos]]), torch.from_numpy(input_ids[pos]).long()

        batches = ram_batches()
    checksum = 0.0
    _, lat, ids = next(batches)
    checksum += float(lat[:, 0, 0, 0].sum()) + int(ids[:, 1].sum())
    startup_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    count = 0
    for _, lat, ids in batches:
        checksum += float(lat[:, 0, 0, 0].sum()) + int(ids[:, 1].sum())
        count += 1
    loop_s = time.perf_counter() - t1
    anon_peak_mb = anon.stop()
    status = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if value.strip().endswith("kB"):
            status[key] = int(value.split()[0]) / 1024
    result = {
        "design": design,
        "samples": n,
        "import_s": import_s,
        "startup_s": startup_s,
        "batches": count,
        "loop_s": loop_s,
        "batches_s": count / loop_s,
        "anon_peak_mb": anon_peak_mb,
        "anon_after_import_mb": anon_after_import_mb,
        "peak_rss_mb": status["VmHWM"],
        "file_rss_end_mb": status["RssFile"],
        "checksum": round(checksum, 3),
    }
    print(json.dumps(result))


# -------------------------------------------------------------------------------------- parent


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="10k samples (under a minute once generated)")
    parser.add_argument("--samples", type=int, help="override the sample count")
    parser.add_argument(
        "--buckets", type=int, default=8, help=f"bucket shapes in the store, 1..{len(BUCKETS)} (1: square-only)"
    )
    parser.add_argument("--clean", action="store_true", help="delete the generated data afterwards")
    parser.add_argument("--child", choices=["ours", "ref"], help=argparse.SUPPRESS)
    parser.add_argument("--root", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child, args.root)
        return
    samples = args.samples or (10_000 if args.quick else 100_000)
    root = data_root(samples, args.buckets)
    generate(root, samples, args.buckets)
    files = design_files(root)
    every = files["ours"] + files["ref"]
    print(f"machine: {machine()}")
    print(f"data: {root} ({sum(p.stat().st_size for p in every) / 1e9:.2f} GB in {len(every)} files)")
    per_bucket = np.bincount(sample_buckets(samples, args.buckets), minlength=args.buckets)
    shapes = ", ".join(
        f"{w}x{h} ({latent_shape((w, h))[2]}x{latent_shape((w, h))[1]} latent) {c}"
        for (w, h), c in zip(BUCKETS, per_bucket.tolist(), strict=False)
    )
    print(f"{args.buckets} bucket(s), samples per bucket: {shapes}; {len(files['ours']) - 1} shard files")
    results = {}
    for design in ("ours", "ref"):
        before = resident_fraction(files[design])
        drop_cache(every)
        cold = {d: resident_fraction(files[d]) for d in files}
        print(
            f"{design}: page cache before drop {before:.1%} resident; after DONTNEED "
            f"ours {cold['ours']:.2%}, ref {cold['ref']:.2%}; load average {load_average()}, {cpu_pressure()}",
            flush=True,
        )
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
        measured = run_measured(python_module("bench.latent_loader", "--child", design, "--root", str(root)), env=env)
        if measured.returncode != 0:
            raise SystemExit(f"{design} child failed with exit status {measured.returncode}")
        res = json.loads(measured.stdout.strip().splitlines()[-1])
        res["cold_resident"] = cold[design]
        results[design] = res
        print(
            f"{design:>4}: start-up {res['startup_s']:.3f} s (imports {res['import_s']:.2f} s), "
            f"{res['batches_s']:.0f} batches/s of {BATCH} over {res['batches']} batches, "
            f"anon RSS peak {res['anon_peak_mb']:.0f} MiB ({res['anon_after_import_mb']:.0f} after imports), "
            f"peak RSS {res['peak_rss_mb']:.0f} MiB (VmHWM; file-backed at end {res['file_rss_end_mb']:.0f} MiB), "
            f"wall {measured.wall_s:.1f} s, CPU {measured.cpu_s:.1f} s",
            flush=True,
        )
    ours, ref = results["ours"], results["ref"]
    if ours["checksum"] != ref["checksum"]:
        raise SystemExit(f"the designs disagree on the data: checksums {ours['checksum']} vs {ref['checksum']}")
    if args.clean:
        shutil.rmtree(root)
    print(
        f"anon RSS ours/ref {ours['anon_peak_mb'] / ref['anon_peak_mb']:.1%}; "
        f"start-up ref/ours {ref['startup_s'] / ours['startup_s']:.0f}x"
    )
    print(
        result_line(
            "latent_loader",
            ref["startup_s"] / ours["startup_s"],
            ours_startup_s=ours["startup_s"],
            ref_startup_s=ref["startup_s"],
            ours_batches_s=ours["batches_s"],
            ref_batches_s=ref["batches_s"],
            ours_anon_rss_mb=ours["anon_peak_mb"],
            ref_anon_rss_mb=ref["anon_peak_mb"],
            ours_peak_rss_mb=ours["peak_rss_mb"],
            ref_peak_rss_mb=ref["peak_rss_mb"],
            samples=samples,
            batches_per_s=ours["batches_s"],
            buckets=args.buckets,
            machine=machine(),
        )
    )


if __name__ == "__main__":
    main()
