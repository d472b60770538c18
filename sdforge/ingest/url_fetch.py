"""URL sources (laion): ``img2dataset.download`` into WebDataset shards through the SSRF guard
(:mod:`sdforge.ingest.url_guard`), each shard canonicalised as soon as it is finished.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import polars as pl
import pyarrow.parquet as pq

from sdforge.config import FetchSettings
from sdforge.ingest import shards, url_credentials, url_guard
from sdforge.ingest.image_convert import SampleResizer
from sdforge.io import InputError

# albumentations (imported by img2dataset) otherwise asks the package index for updates
os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")

log = logging.getLogger(__name__)


class FetchIncomplete(RuntimeError):
    """img2dataset returned with shards unfinished; a rerun fetches only those."""


@contextlib.contextmanager
def _interrupts_stay_interrupts() -> Iterator[None]:
    """Undo img2dataset's SIGINT handler, which exits with status 0 (a DVC stage would look successful)."""
    saved = signal.getsignal(signal.SIGINT)
    try:
        yield
    except SystemExit as exc:
        if exc.code in (0, None):
            raise KeyboardInterrupt("img2dataset was interrupted (SIGINT)") from None
        raise
    finally:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, saved)


def fetch_urls(filtered: Path, out_dir: Path, fetch: FetchSettings, rows: int) -> None:
    """Fetch the ``url``/``caption`` rows of ``filtered`` into webdataset shards in ``out_dir``.

    Only the shards ``out_dir`` does not hold finished yet are fetched (img2dataset's incremental
    mode), through :class:`sdforge.ingest.url_guard.GuardedDownloader`, which decodes every image with
    :class:`~sdforge.ingest.image_convert.SampleResizer` (as the local kinds are) and canonicalises each shard in
    its worker as soon as it is finished; a last pass canonicalises any shard left raw (a kill
    between img2dataset's stats and that step, or a failure there).
    Raises :class:`FetchIncomplete` when img2dataset gave up on a shard.
    """
    from img2dataset import download  # lazy: pulls albumentations/wandb (~2 s); only URL sources need it

    expected = set(range(math.ceil(rows / fetch.shard_size)))
    start = time.perf_counter()
    if expected - set(shards.finished_shards(out_dir)):
        canonicalize = functools.partial(shards.canonicalize_shard, str(out_dir.resolve()), final=False)
        resizer = SampleResizer(fetch)  # decodes like the local kinds' re-shard (one decode policy)
        guard = url_guard.guarded_img2dataset(fetch.allow_networks, resizer, after_shard=canonicalize)
        with guard, _interrupts_stay_interrupts():
            download(
                url_list=str(filtered),
                input_format="parquet",
                url_col="url",
                caption_col="caption",
                output_format="webdataset",
                output_folder=str(out_dir),
                image_size=fetch.image_size,
                resize_mode=fetch.resize_mode,
                processes_count=fetch.processes,
                thread_count=fetch.threads,
                timeout=fetch.timeout,
                retries=fetch.retries,
                number_sample_per_shard=fetch.shard_size,
                distributor=fetch.distributor,
                encode_quality=fetch.encode_quality,
                user_agent_token=fetch.user_agent_token,
                incremental_mode="incremental",
                enable_wandb=False,
            )
    missing = sorted(expected - set(shards.finished_shards(out_dir)))
    if missing:
        raise FetchIncomplete(
            f"img2dataset did not finish shards {missing} of {out_dir} (see its log above); "
            "rerun the stage: finished shards are kept and only these are fetched"
        )
    fetched = time.perf_counter()
    check_guard_ran(out_dir)
    shards.canonicalize_folder(out_dir)
    log.info(
        "img2dataset: %.1f s; guard check and canonicalisation: %.1f s",
        fetched - start,
        time.perf_counter() - fetched,
    )


def check_no_credentials(filtered: Path) -> None:
    """:class:`InputError` when a URL of ``filtered`` still carries credentials: img2dataset would store it as it is
    in every shard (the filter stores them redacted, :mod:`sdforge.ingest.url_credentials`)."""
    url = pl.col("url").cast(pl.String)
    found = pl.scan_parquet(filtered).select((url_credentials.redacted(url) != url).sum()).collect().item() or 0
    if found:
        raise InputError(
            f"{filtered}: {found} URL(s) carry credentials (scheme://user:secret@host), which the shards would "
            "store; run filter_metadata again (it stores them redacted)"
        )


def check_guard_ran(out_dir: Path) -> None:
    """Fail unless every non-http(s) URL in the shards' parquets was refused by the guard (it ran in the workers)."""
    for parquet in sorted(out_dir.glob("*.parquet")):
        table = pq.read_table(parquet, columns=["url", "error_message"])
        for url, message in zip(table["url"].to_pylist(), table["error_message"].to_pylist(), strict=True):
            if url_guard.scheme_refusal(url) is not None and url_guard.REFUSED_SCHEME not in (message or ""):
                raise RuntimeError(
                    f"{parquet}: {url!r} was not refused by the URL guard ({message!r}); "
                    "the guard did not run in img2dataset's workers"
                )
