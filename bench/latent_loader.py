"""Benchmark: the training loader over the memory-mapped latent store vs one ``.npy`` per sample loaded into RAM.

``python -m bench.latent_loader`` (100k samples of 4×64×64 fp16, ≈3.3 GB per design on disk) or
``--quick`` (10k). The data are generated once and cached under ``data/bench/latent_loader/<n>/``
(git-ignored; ``SDFORGE_BENCH_DATA`` moves it; ``--clean`` deletes it after the run):

- ``store/bench/shard-NNNNN.safetensors`` (4096 rows each, :func:`sdforge.latents.store.write_shard`),
  its ``manifest.parquet`` and ``mix.parquet``, a phase index over all samples built by
  :func:`stages.mix_phase.build_index` (so in shuffled order, like a real phase index);
- ``npy/NNN/NNNNNNN.npy``, the same latents one file per sample, plus ``npy/input_ids.npy``.

Each design runs in a fresh subprocess, ours first, after every file of *both* designs has been
dropped from the page cache (``fdatasync`` was done at generation; ``posix_fadvise(DONTNEED)`` per
file, which needs no root) — the parent checks with ``mincore(2)`` that almost none of either
design's pages are resident before each run and prints the fraction. In each child:

- ours: ``LatentIndexDataset(mix.parquet, store)``, then ``iter_batches`` over one shuffled epoch;
- reference: the index's files loaded by ``ThreadPoolExecutor(16)`` + ``np.load`` into one
  preallocated ``[N, 4, 64, 64]`` fp16 array (the token ids from one ``.npy``), then the same
  ``rank_order`` batches gathered from RAM and converted exactly as the trainer receives them (with
  the loader's own :func:`~sdforge.latents.loader.to_float32`, so only the design differs).

Start-up is the seconds from constructing the loader to holding the first batch (imports excluded;
printed apart). Batches/s is over the whole epoch of batches of 24 after the first. Anonymous
(private) RSS is the peak of ``RssAnon`` from ``/proc/self/status`` sampled every 20 ms; peak RSS is
the child's ``VmHWM`` (file-backed page-cache pages of the memmaps included). Not ``wait4``'s
``ru_maxrss``: Linux carries the parent's high-water mark over ``exec`` into it. The last
line is ``RESULT name=latent_loader ratio=<reference start-up / ours> ...``.
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

from bench._common import BENCH_DATA, load_average, machine, python_module, result_line, run_measured
from sdforge.config import Phase
from sdforge.latents.loader import LatentIndexDataset, batches_per_epoch, iter_batches, rank_order, to_float32
from sdforge.latents.store import MANIFEST, shard_path, write_shard
from stages.mix_phase import build_index

SHAPE = (4, 64, 64)
SHARD_ROWS = 4096
BATCH = 24
THREADS = 16
SOURCE = "bench"
SEED = 20240601


# ------------------------------------------------------------------------------------------ data


def data_root(samples: int) -> Path:
    return BENCH_DATA / "latent_loader" / str(samples)


def npy_path(root: Path, i: int) -> Path:
    return root / "npy" / f"{i // 1000:03d}" / f"{i:07d}.npy"


def generate(root: Path, samples: int) -> None:
    """Write both designs' files for ``samples`` samples (same values) unless already complete."""
    done = root / "DONE"
    if done.is_file():
        return
    import numpy as np
    import polars as pl
    import torch

    if root.exists():
        shutil.rmtree(root)
    print(f"generating {samples} samples under {root} (once)", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    rng = np.random.default_rng(SEED)
    all_ids = np.empty((samples, 77), dtype=np.int32)
    for shard, start in enumerate(range(0, samples, SHARD_ROWS)):
        n = min(SHARD_ROWS, samples - start)
        latents = rng.standard_normal((n, *SHAPE), dtype=np.float32).astype(np.float16)
        ids = rng.integers(0, 49408, (n, 77), dtype=np.int32)
        all_ids[start : start + n] = ids
        write_shard(shard_path(root / "store", SOURCE, shard), torch.from_numpy(latents), torch.from_numpy(ids))
        for j in range(n):
            path = npy_path(root, start + j)
            path.parent.mkdir(parents=True, exist_ok=True)
            np.save(path, latents[j])
    np.save(root / "npy" / "input_ids.npy", all_ids)
    keys = [f"{i:07d}" for i in range(samples)]
    manifest = pl.DataFrame(
        {
            "key": keys,
            "caption": ["c"] * samples,
            "source": [SOURCE] * samples,
            "shard": [i // SHARD_ROWS for i in range(samples)],
            "row": [i % SHARD_ROWS for i in range(samples)],
        }
    )
    manifest.write_parquet(root / "store" / SOURCE / MANIFEST)
    index = build_index("bench", Phase(mix={SOURCE: 1.0}, samples=samples, lr=1.0), {SOURCE: manifest}, seed=0)
    index.write_parquet(root / "mix.parquet")
    os.sync()  # everything clean on disk, so DONTNEED can drop it
    done.write_text(json.dumps({"samples": samples, "seconds": round(time.perf_counter() - t0, 1)}))
    print(f"generated in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)


def design_files(root: Path) -> dict[str, list[Path]]:
    """Every file each design reads."""
    store = sorted((root / "store" / SOURCE).glob("shard-*.safetensors")) + [root / "mix.parquet"]
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

    import numpy as np
    import polars as pl
    import torch

    import_s = time.perf_counter() - t_import
    anon = AnonPeak()
    anon_after_import_mb = anon.peak_kb / 1024
    t0 = time.perf_counter()
    if design == "ours":
        data = LatentIndexDataset(root / "mix.parquet", root / "store")
        batches = iter_batches(data, epoch=0, seed=0, rank=0, world=1, batch_size=BATCH)
        n = len(data)
    else:
        index = pl.read_parquet(root / "mix.parquet")
        sample = [int(k) for k in index["key"].to_list()]  # the key is the sample number
        n = len(sample)
        latents = np.empty((n, *SHAPE), dtype=np.float16)
        input_ids = np.load(root / "npy" / "input_ids.npy")[sample]

        def load(pos: int) -> None:
            latents[pos] = np.load(npy_path(root, sample[pos]))

        with ThreadPoolExecutor(THREADS) as pool:
            list(pool.map(load, range(n), chunksize=256))

        def ram_batches():
            order = rank_order(n, 0, 0, 0, 1)
            for b in range(batches_per_epoch(n, 1, BATCH)):
                pos = order[b * BATCH : (b + 1) * BATCH]
                yield b, to_float32(latents[pos]), torch.from_numpy(input_ids[pos]).long()

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
    parser.add_argument("--clean", action="store_true", help="delete the generated data afterwards")
    parser.add_argument("--child", choices=["ours", "ref"], help=argparse.SUPPRESS)
    parser.add_argument("--root", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child, args.root)
        return
    samples = args.samples or (10_000 if args.quick else 100_000)
    root = data_root(samples)
    generate(root, samples)
    files = design_files(root)
    every = files["ours"] + files["ref"]
    print(f"machine: {machine()}")
    print(f"data: {root} ({sum(p.stat().st_size for p in every) / 1e9:.2f} GB in {len(every)} files)")
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
            machine=machine(),
        )
    )


if __name__ == "__main__":
    main()
