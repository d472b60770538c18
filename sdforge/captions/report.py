"""What a captioned source looks like, for the stage's metrics and MLflow: counts over every shard's parquet
(synthetic vs kept original, by reason), the CLIP token-length distribution and truncation rate, and a table of
sampled images with both captions."""

from __future__ import annotations

import io
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from sdforge.bounds.images import DEFAULT_MAX_PIXELS, ImageRejected, open_bounded
from sdforge.captions.shards import IMAGE_EXTS
from sdforge.ingest.shards import read_tar

TABLE_COLUMNS = ("key", "original_caption", "synthetic_caption", "generated", "rejected", "tokens")


def read_all(out_dir: Path) -> pa.Table:
    """Every shard parquet of ``out_dir``, with a ``shard`` column (the file's stem), in shard order."""
    tables = []
    for path in sorted(out_dir.glob("*.parquet")):
        table = pq.read_table(path)
        tables.append(table.append_column("shard", pa.array([path.stem] * table.num_rows)))
    return pa.concat_tables(tables) if tables else pa.table({c: [] for c in (*TABLE_COLUMNS, "shard")})


def caption_summary(out_dir: Path, max_tokens: int) -> dict:
    """``images``, ``synthetic`` (captions used), ``rejected`` and ``rejected_by_reason``, token-length
    percentiles of the generations (``tokens.p50/p90/max``), ``truncation_rate`` (over ``max_tokens``)."""
    table = read_all(out_dir)
    rejected = [r for r in table["rejected"].to_pylist() if r] if table.num_rows else []
    tokens = np.asarray(table["tokens"].to_pylist() if table.num_rows else [0], dtype=np.int64)
    made = tokens[tokens > 0] if (tokens > 0).any() else np.zeros(1, np.int64)
    return {
        "images": table.num_rows,
        "synthetic": table.num_rows - len(rejected),
        "rejected": len(rejected),
        "rejected_by_reason": dict(sorted(Counter(rejected).items())),
        "tokens.p50": int(np.percentile(made, 50)),
        "tokens.p90": int(np.percentile(made, 90)),
        "tokens.max": int(made.max()),
        "truncation_rate": round(float((tokens > max_tokens).mean()), 6) if table.num_rows else 0.0,
    }


def sample_table(out_dir: Path, shards_dir: Path, n: int, max_pixels: int = DEFAULT_MAX_PIXELS) -> dict[str, list]:
    """``n`` rows spread evenly over the source (same rows every run), with their images (PIL: MLflow stores
    them with the table; a header over ``max_pixels`` is not decoded) and both captions."""
    table = read_all(out_dir)
    picks = sorted(set(np.linspace(0, table.num_rows - 1, min(n, table.num_rows)).astype(int).tolist()))
    rows = [table.slice(i, 1).to_pylist()[0] for i in picks]
    out: dict[str, list] = {c: [r[c] for r in rows] for c in (*TABLE_COLUMNS, "shard")}
    tars = {shard: read_tar(shards_dir / f"{shard}.tar") for shard in {r["shard"] for r in rows}}
    out["image"] = [_to_image(tars[r["shard"]].get(r["key"], {}), max_pixels) for r in rows]
    return out


def _to_image(sample: dict[str, bytes], max_pixels: int = DEFAULT_MAX_PIXELS):
    """The sample's image (RGB PIL), or a 1×1 grey placeholder for a missing, unreadable or too large one."""
    # lazy: PIL only for the table's images
    from PIL import Image

    data = next((sample[e] for e in IMAGE_EXTS if e in sample), None)
    try:
        return open_bounded(io.BytesIO(data), max_pixels) if data else Image.new("RGB", (1, 1), 128)
    except ImageRejected:
        return Image.new("RGB", (1, 1), 128)


def length_figure(out_dir: Path, metrics: dict):
    """Histogram of the generations' CLIP token counts, the cap marked."""
    # lazy: matplotlib (~0.5 s) only to draw the figure
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy with matplotlib, after choosing the headless backend

    tokens = read_all(out_dir)["tokens"].to_pylist()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.hist([t for t in tokens if t > 0], bins=40, color="#4c72b0")
    ax.set_xlabel("CLIP tokens of the generated caption")
    ax.set_ylabel("images")
    p50, p90, rate = metrics["tokens.p50"], metrics["tokens.p90"], metrics["truncation_rate"]
    ax.set_title(f"median {p50}, p90 {p90}, truncated {rate:.1%}")
    fig.tight_layout()
    return fig
