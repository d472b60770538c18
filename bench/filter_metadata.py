"""Benchmark: the ``filter_metadata`` stage (LAION kind) vs a straightforward pandas version of the same rules.

``python -m bench.filter_metadata`` (10M rows) or ``--quick`` (1M rows). A synthetic LAION-schema
metadata set (``URL, TEXT, WIDTH, HEIGHT, similarity, punsafe, pwatermark, AESTHETIC_SCORE, hash``;
realistic-looking distributions, repeated URLs (some with an upper-cased host or padding spaces),
repeated hashes, nulls, NaNs, empty and very long captions) is generated once, in several parquet
files of several row groups, and cached under ``data/bench/filter_metadata/`` (git-ignored).

Each implementation then runs in a fresh subprocess (peak RSS is its own, via ``wait4``), ours first:
``filter_metadata.run(...)`` with ``tracking=None``, and pandas (``read_parquet``, boolean masks,
``drop_duplicates(keep="first")`` on the normalised URL, then on ``hash``, ``to_parquet``). The row
counts and the kept URLs (in order) must be equal. Times are the work inside each child (imports and
interpreter start-up excluded; both are printed); the runs are interleaved ``--repeat`` times (3) and
the fastest of each counts, since the machine may be shared (its load average is printed; CPU
seconds are printed too). The last line is ``RESULT name=filter_metadata ...``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

from bench._common import BENCH_DATA, load_average, machine, python_module, result_line, run_measured
from sdforge.config import FilterRules, Source
from stages import filter_metadata

RULES = {  # phase 1 of the full configuration
    "min_aesthetic": 6.5,
    "min_similarity": 0.28,
    "min_width": 512,
    "min_height": 512,
    "max_pwatermark": 0.5,
    "max_punsafe": 0.5,
    "dedup_url": True,
    "dedup_hash": True,
}
FILES = 8
ROW_GROUP = 100_000
SEED = 20240601
WORDS = (
    "a photo of the an old red blue green small large vintage modern portrait landscape painting woman man "
    "dog cat house tree city street night sunset beach mountain river forest car flower bird logo poster "
    "watercolor oil canvas print wall art design pattern white black background close up view"
).split()
URL_PATTERN = r"^([A-Za-z][A-Za-z0-9+.\-]*://[^/?#]*)(.*)$"  # as stages.filter_metadata


def _mix64(x):
    """splitmix64 finaliser (numpy uint64): index → pseudo-random 64-bit value."""
    import numpy as np

    x = (x + np.uint64(0x9E3779B97F4A7C15)).astype(np.uint64)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _urls(index):
    """URL of each global row index (a pure function of it, so a repeat is the same URL)."""
    import numpy as np
    import polars as pl

    h = _mix64(index.astype(np.uint64))
    hosts = pl.Series(["img", "media", "static", "i"]).gather(pl.Series((h % np.uint64(4)).astype(np.int64)))
    return pl.format(
        "https://{}.cdn{}.example.com/images/{}/{}.jpg",
        pl.lit(hosts),
        pl.lit(pl.Series((h % np.uint64(997)).astype(np.int64))),
        pl.lit(pl.Series(((h >> np.uint64(10)) % np.uint64(100_000)).astype(np.int64))),
        pl.lit(pl.Series(index)),
    )


def generate_part(path: Path, start: int, rows: int, seed: int) -> None:
    """Write rows ``start .. start+rows`` of the synthetic set to ``path`` (deterministic per seed)."""
    import numpy as np
    import polars as pl

    rng = np.random.default_rng(seed)
    index = np.arange(start, start + rows, dtype=np.int64)
    # 4 % of rows repeat an earlier row's URL (a third with an upper-cased host, a third padded with spaces),
    # 2 % repeat an earlier row's hash under a new URL; 0.05 % null URLs, 0.1 % null hashes.
    url_src = index.copy()
    dup_url = rng.random(rows) < 0.04
    url_src[dup_url] = (rng.random(dup_url.sum()) * (index[dup_url] + 1)).astype(np.int64)
    hash_src = index.copy()
    dup_hash = rng.random(rows) < 0.02
    hash_src[dup_hash] = (rng.random(dup_hash.sum()) * (index[dup_hash] + 1)).astype(np.int64)
    variant = rng.integers(0, 3, rows)
    # a repeated URL or hash is the same image: its quality values are a function of the row it repeats
    image = np.where(dup_url, url_src, hash_src).astype(np.uint64)

    def uniform(k: int):
        return (_mix64(image * np.uint64(16) + np.uint64(k)) >> np.uint64(11)).astype(np.float64) / 2.0**53

    def normal(k: int, mean: float, std: float):
        return mean + std * np.sqrt(-2 * np.log1p(-uniform(k))) * np.cos(2 * np.pi * uniform(k + 1))

    words = pl.Series(WORDS)
    n_words = len(WORDS)
    caption_words = [words.gather(pl.Series(rng.integers(0, n_words, rows))) for _ in range(12)]
    caption_len = np.minimum(rng.geometric(1 / 60, rows), 300)
    caption_len[rng.random(rows) < 0.005] = 0
    long_caption = rng.random(rows) < 0.0002

    def with_nulls(values, fraction, nan=False):
        values = values.astype(np.float64) if nan else values
        series = pl.Series(values)
        where = np.flatnonzero(rng.random(rows) < fraction)
        return series.scatter(where, float("nan") if nan else None)

    width = np.round(np.exp(normal(0, np.log(700), 0.45))).astype(np.int64)
    height = np.round(width * np.exp(normal(2, -0.1, 0.3))).astype(np.int64)
    url = pl.select(_urls(url_src)).to_series()
    upper, padded = pl.Series(dup_url & (variant == 1)), pl.Series(dup_url & (variant == 2))
    url = pl.select(
        pl.when(upper)
        .then(url.str.extract(URL_PATTERN, 1).str.to_uppercase() + url.str.extract(URL_PATTERN, 2))
        .when(padded)
        .then(pl.lit("  ") + url + pl.lit(" "))
        .otherwise(url)
    ).to_series()
    caption = pl.select(pl.concat_str(caption_words, separator=" ")).to_series()
    caption = pl.select(
        pl.when(pl.Series(long_caption))
        .then(caption.repeat_by(40).list.join(" "))
        .otherwise(caption.str.slice(0, pl.Series(caption_len)))
    ).to_series()
    df = pl.DataFrame(
        {
            "URL": url.scatter(np.flatnonzero(rng.random(rows) < 0.0005), None),
            "TEXT": caption,
            "WIDTH": with_nulls(width, 0.002),
            "HEIGHT": with_nulls(height, 0.002),
            "similarity": with_nulls(normal(4, 0.31, 0.035), 0.001, nan=True),
            "punsafe": with_nulls(uniform(6) ** 6, 0.002).cast(pl.Float32),
            "pwatermark": with_nulls(uniform(7) ** 1.5, 0.01).cast(pl.Float32),
            "AESTHETIC_SCORE": with_nulls(normal(8, 5.9, 0.7), 0.001, nan=True).cast(pl.Float32),
            "hash": with_nulls(_mix64(hash_src.astype(np.uint64)).view(np.int64), 0.001),
        }
    )
    tmp = path.with_suffix(".tmp")
    df.write_parquet(tmp, compression="snappy", row_group_size=ROW_GROUP)
    os.replace(tmp, path)


def dataset(rows: int) -> Path:
    """The cached synthetic set of ``rows`` rows (generated on first use); its folder."""
    root = BENCH_DATA / "filter_metadata" / f"rows-{rows}"
    done = root / "COMPLETE"
    if done.exists():
        return root / "metadata"
    shutil.rmtree(root, ignore_errors=True)
    (root / "metadata").mkdir(parents=True)
    per_file = -(-rows // FILES)
    start = time.perf_counter()
    for i in range(FILES):
        lo, hi = i * per_file, min(rows, (i + 1) * per_file)
        generate_part(root / "metadata" / f"part-{i:05d}.parquet", lo, hi - lo, SEED + i)
    done.write_text(f"{rows}\n")
    print(f"generated {rows} rows in {FILES} files in {time.perf_counter() - start:.1f}s under {root}", flush=True)
    return root / "metadata"


# --- the two implementations (each run in its own child process) ------------------------------------------


def run_ours(data: Path, out: Path) -> int:
    """The stage itself, as DVC runs it minus MLflow; returns rows out."""
    source = Source(kind="laion", repo=str(data), filter=FilterRules(**RULES))
    return filter_metadata.run(source, "laion", data, out)["rows_out"]


COLUMNS = {  # configured (LAION) name → normalised name, as sdforge.config.Columns
    "URL": "url",
    "TEXT": "caption",
    "WIDTH": "width",
    "HEIGHT": "height",
    "similarity": "similarity",
    "punsafe": "punsafe",
    "pwatermark": "pwatermark",
    "AESTHETIC_SCORE": "aesthetic",
    "hash": "hash",
}


def run_pandas(data: Path, out: Path) -> int:
    """The same rules, written the straightforward pandas way; returns rows out."""
    import numpy as np
    import pandas as pd

    files = sorted(data.rglob("*.parquet"))
    df = pd.concat([pd.read_parquet(f) for f in files], ignore_index=True).rename(columns=COLUMNS)
    for name in ("width", "height", "similarity", "punsafe", "pwatermark", "aesthetic"):
        df[name] = pd.to_numeric(df[name], errors="coerce").astype("float64")
    df["url"] = df["url"].str.strip()
    keep = pd.Series(True, index=df.index)
    for name, rule in (
        ("aesthetic", "min_aesthetic"),
        ("similarity", "min_similarity"),
        ("width", "min_width"),
        ("height", "min_height"),
    ):
        keep &= np.isfinite(df[name]) & (df[name] >= max(RULES[rule], 0))
    for name, rule in (("pwatermark", "max_pwatermark"), ("punsafe", "max_punsafe")):
        keep &= (df[name] >= 0) & (df[name] < RULES[rule])
    df = df[keep]
    parts = df["url"].str.extract(r"^([A-Za-z][A-Za-z0-9+.\-]*://[^/?#]*)(.*)$")
    url_key = (parts[0].str.lower() + parts[1]).fillna(df["url"])
    df = df[url_key.notna() & (url_key != "")]
    df = df[~url_key[df.index].duplicated(keep="first")]
    df = df[df["hash"].notna()]
    df = df.drop_duplicates(subset="hash", keep="first")
    df["width"] = df["width"].astype("Int64")
    df["height"] = df["height"].astype("Int64")
    out.mkdir(parents=True, exist_ok=True)
    df.to_parquet(out / "filtered.parquet", index=False)
    return len(df)


def child(impl: str, data: Path, out: Path) -> None:
    """``--child``: import, run one implementation, print ``{"rows_out", "work_s", "import_s"}`` as JSON."""
    start = time.perf_counter()
    if impl == "ours":
        import polars  # noqa: F401

    else:
        import pandas  # noqa: F401
        import pyarrow  # noqa: F401
    imported = time.perf_counter()
    rows_out = {"ours": run_ours, "pandas": run_pandas}[impl](data, out)
    done = time.perf_counter()
    print(json.dumps({"rows_out": rows_out, "work_s": done - imported, "import_s": imported - start}))


# --- the comparison --------------------------------------------------------------------------------------


def kept_urls(out: Path):
    """The kept rows' URLs, in order (both implementations keep file then row order)."""
    import polars as pl

    return pl.read_parquet(out / "filtered.parquet", columns=["url"])["url"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.filter_metadata", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="1M rows instead of 10M (under a minute)")
    parser.add_argument("--rows", type=int, help="rows to generate (overrides --quick)")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each, interleaved; the fastest counts")
    parser.add_argument("--child", choices=["ours", "pandas"], help=argparse.SUPPRESS)
    parser.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child, args.data, args.out)
        return
    rows = args.rows or (1_000_000 if args.quick else 10_000_000)
    data = dataset(rows)
    outs = {impl: BENCH_DATA / "filter_metadata" / f"out-{impl}" for impl in ("ours", "pandas")}
    where = machine()
    print(f"machine: {where}; load average before: {load_average()}", flush=True)
    print(f"{rows:,} rows in {len(list(data.glob('*.parquet')))} files, rules {RULES}", flush=True)
    runs: dict[str, list[tuple]] = {"ours": [], "pandas": []}
    for i in range(args.repeat):
        for impl in ("ours", "pandas"):
            shutil.rmtree(outs[impl], ignore_errors=True)
            cmd = python_module("bench.filter_metadata", "--child", impl, "--data", str(data), "--out", str(outs[impl]))
            measured = run_measured(cmd, env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
            if measured.returncode != 0:
                sys.exit(f"{impl} failed (exit {measured.returncode})")
            report = json.loads(measured.stdout.strip().splitlines()[-1])
            runs[impl].append((report, measured))
            print(
                f"run {i + 1} {impl:>6}: {report['work_s']:6.2f} s work (+{report['import_s']:.2f} s imports; "
                f"{measured.wall_s:.2f} s process wall, {measured.cpu_s:.2f} s CPU), "
                f"peak RSS {measured.peak_rss_mb:,.0f} MiB, {report['rows_out']:,} rows out",
                flush=True,
            )
    rows_out = {impl: {r["rows_out"] for r, _ in results} for impl, results in runs.items()}
    if len(rows_out["ours"] | rows_out["pandas"]) != 1:
        sys.exit(f"row counts differ: {rows_out}")
    ours_urls, pandas_urls = kept_urls(outs["ours"]), kept_urls(outs["pandas"])
    if not ours_urls.equals(pandas_urls):
        sys.exit(f"kept URLs differ: ours {ours_urls.len()} rows, pandas {pandas_urls.len()} rows")
    print(f"equal: {ours_urls.len():,} rows out, the same URLs in the same order", flush=True)
    for out in outs.values():
        shutil.rmtree(out, ignore_errors=True)

    def best(impl: str) -> float:
        return min(r["work_s"] for r, _ in runs[impl])

    def peak(impl: str) -> float:
        return max(m.peak_rss_mb for _, m in runs[impl])

    def cpu(impl: str) -> float:
        return min(m.cpu_s for _, m in runs[impl])

    def median(impl: str) -> float:
        return statistics.median(r["work_s"] for r, _ in runs[impl])

    ours_s, pandas_s = best("ours"), best("pandas")
    print(
        f"fastest of {args.repeat}: ours {ours_s:.2f} s ({cpu('ours'):.2f} s CPU), pandas {pandas_s:.2f} s "
        f"({cpu('pandas'):.2f} s CPU); medians ours {median('ours'):.2f} s, pandas {median('pandas'):.2f} s "
        f"(ratio {median('pandas') / median('ours'):.2f}); peak RSS ours {peak('ours'):,.0f} MiB, "
        f"pandas {peak('pandas'):,.0f} MiB; load average after: {load_average()}",
        flush=True,
    )
    print(
        result_line(
            "filter_metadata",
            pandas_s / ours_s,
            ours_s=ours_s,
            pandas_s=pandas_s,
            ours_peak_rss_mb=peak("ours"),
            pandas_peak_rss_mb=peak("pandas"),
            rss_ratio=peak("pandas") / peak("ours"),
            ours_cpu_s=cpu("ours"),
            pandas_cpu_s=cpu("pandas"),
            rows=rows,
            rows_out=ours_urls.len(),
            machine=where,
        )
    )


if __name__ == "__main__":
    main()
