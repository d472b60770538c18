"""Benchmark: OpenCV vs PIL JPEG decode + resize + centre crop, one thread and a thread pool.

``python -m bench.decode [--quick] [--images 300] [--size 512] [--workers N]``

Each image is a synthetic 1024×768 (w×h) photo-like JPEG (smooth colour field + texture + noise,
quality 90, ~150 kB). Work per image, both libraries: decode to RGB, shorter side → ``--size``,
centre crop ``--size``². OpenCV: ``imdecode`` + ``cvtColor`` + ``resize(INTER_AREA)`` (what
``sdforge.latents.inputs.decode_sample`` does); PIL: ``Image.open().convert("RGB")`` +
``resize(Resampling.BOX)`` (PIL's area filter, the same maths) + ``crop``. Both libraries decode with
libjpeg-turbo, so the difference is mostly resize, colour conversion and per-call overhead.

Modes alternate inside each round (cv2 1 thread, PIL 1 thread, cv2 pool, PIL pool, and cv2 with
OpenCV's own ``parallel_for`` threads in one calling thread; the order is reversed every other
round); figures are medians over ``--rounds``. The cv2 modes other than the last run with
``cv2.setNumThreads(1)`` so that "1 thread" means one core. ratio = cv2 / PIL throughput with the
pool (what the encode pipeline runs); the single-thread ratio is printed too.
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import cv2
import numpy as np
from PIL import Image

from bench._common import BENCH_DATA, machine, result_line


def make_jpegs(n: int, width: int = 1024, height: int = 768) -> list[bytes]:
    """``n`` photo-like JPEGs (cached under ``BENCH_DATA/decode``)."""
    folder = BENCH_DATA / "decode" / f"{width}x{height}"
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        path = folder / f"{i:05d}.jpg"
        if not path.exists():
            base = cv2.resize(
                rng.integers(0, 256, (6, 8, 3), dtype=np.uint8), (width, height), interpolation=cv2.INTER_CUBIC
            )
            texture = cv2.GaussianBlur(rng.normal(0, 25, (height, width, 3)).astype(np.float32), (0, 0), 2.0)
            img = np.clip(base + texture + rng.normal(0, 4, base.shape), 0, 255).astype(np.uint8)
            ok, buf = cv2.imencode(".jpg", img, [cv2.IMWRITE_JPEG_QUALITY, 90])
            assert ok
            tmp = path.with_suffix(".tmp")
            tmp.write_bytes(buf.tobytes())
            os.replace(tmp, path)
        out.append(path.read_bytes())
    return out


def _box(h: int, w: int, size: int) -> tuple[int, int, int, int]:
    scale = size / min(h, w)
    nh, nw = max(size, round(h * scale)), max(size, round(w * scale))
    return nh, nw, (nh - size) // 2, (nw - size) // 2


def cv2_decode(data: bytes, size: int) -> np.ndarray:
    bgr = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
    nh, nw, top, left = _box(*bgr.shape[:2], size)
    bgr = cv2.resize(bgr, (nw, nh), interpolation=cv2.INTER_AREA)[top : top + size, left : left + size]
    return cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)


def pil_decode(data: bytes, size: int) -> np.ndarray:
    img = Image.open(io.BytesIO(data))
    img = img if img.mode == "RGB" else img.convert("RGB")
    nh, nw, top, left = _box(img.height, img.width, size)
    img = img.resize((nw, nh), Image.Resampling.BOX).crop((left, top, left + size, top + size))
    return np.asarray(img)


def throughput(fn, jpegs: list[bytes], size: int, workers: int) -> float:
    """Images per second of ``fn`` over ``jpegs`` with ``workers`` threads (1: a plain loop)."""
    t0 = time.perf_counter()
    if workers == 1:
        for data in jpegs:
            fn(data, size)
    else:
        with ThreadPoolExecutor(workers) as pool:
            for _ in pool.map(fn, jpegs, [size] * len(jpegs), chunksize=8):
                pass
    return len(jpegs) / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.decode", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="80 images, 3 rounds (a few seconds)")
    parser.add_argument("--images", type=int, default=300)
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    if args.quick:
        args.images, args.rounds = 80, 3
    jpegs = make_jpegs(args.images)
    a, b = cv2_decode(jpegs[0], args.size), pil_decode(jpegs[0], args.size)
    assert a.shape == b.shape == (args.size, args.size, 3)
    mae = float(np.abs(a.astype(np.float32) - b.astype(np.float32)).mean())
    w = args.workers
    cv2_threads = cv2.getNumThreads()

    # (name, function, calling threads, OpenCV's own threads per call)
    modes = [("cv2", cv2_decode, 1, 1), ("pil", pil_decode, 1, 1), ("cv2", cv2_decode, w, 1), ("pil", pil_decode, w, 1)]
    modes.append(("cv2-own-threads", cv2_decode, 1, cv2_threads))
    runs: dict[tuple[str, int], list[float]] = {(name, n): [] for name, _, n, _ in modes}
    for r in range(args.rounds):
        for name, fn, workers, per_call in modes if r % 2 == 0 else modes[::-1]:
            cv2.setNumThreads(per_call)
            runs[(name, workers)].append(throughput(fn, jpegs, args.size, workers))
        print(f"round {r + 1}: " + ", ".join(f"{n} x{k} {v[-1]:.0f} img/s" for (n, k), v in runs.items()), flush=True)
    cv2.setNumThreads(cv2_threads)
    med = {k: statistics.median(v) for k, v in runs.items()}
    print(
        result_line(
            "decode",
            med[("cv2", w)] / med[("pil", w)],
            ratio_single=med[("cv2", 1)] / med[("pil", 1)],
            cv2_img_s=med[("cv2", 1)],
            pil_img_s=med[("pil", 1)],
            cv2_pool_img_s=med[("cv2", w)],
            pil_pool_img_s=med[("pil", w)],
            cv2_own_threads_img_s=med[("cv2-own-threads", 1)],
            cv2_own_threads=cv2_threads,
            workers=w,
            images=args.images,
            src="1024x768",
            size=args.size,
            mean_abs_diff=mae,
            rounds=args.rounds,
            load=os.getloadavg()[0],
            machine=machine(),
        )
    )


if __name__ == "__main__":
    main()
