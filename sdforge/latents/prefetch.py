"""Read-ahead for the encode pipeline's input tars (:mod:`sdforge.latents.pipeline`).

While the reader streams input ``i``, :class:`Prefetcher` already works on the next ``ahead``: local
files are ``posix_fadvise(WILLNEED)``-ed, s3:// objects are downloaded into ``tmp_dir`` by a small
thread pool and deleted again once read.
"""

from __future__ import annotations

import contextlib
import os
from concurrent.futures import Future, ThreadPoolExecutor

from sdforge.latents.inputs import TarInput
from sdforge.latents.s3_inputs import download


class Prefetcher:
    """Makes input ``i`` local: the next ``ahead`` files are fadvise(WILLNEED)d, s3:// objects downloaded."""

    def __init__(self, tars: list[TarInput], ahead: int, tmp_dir: str | None):
        self.tars, self.ahead, self.tmp_dir = tars, ahead, tmp_dir
        self.s3 = any(t.path.startswith("s3://") for t in tars)
        self.pool = ThreadPoolExecutor(max(1, ahead), thread_name_prefix="prefetch") if self.s3 else None
        self.jobs: dict[int, Future] = {}
        self.started: set[int] = set()

    def local_path(self, i: int) -> str:
        """Start inputs ``i .. i + ahead`` if not started yet; return input ``i``'s local path (after its download)."""
        for j in range(i, min(i + self.ahead + 1, len(self.tars))):
            if j not in self.started:
                self.started.add(j)
                self._start(j)
        return self.jobs.pop(i).result() if self.s3 else self.tars[i].path

    def _start(self, j: int) -> None:
        tar = self.tars[j]
        if self.s3:
            self.jobs[j] = self.pool.submit(_download, tar.path, os.path.join(self.tmp_dir, f"{j}-{tar.name}"))
        elif hasattr(os, "posix_fadvise"):
            with contextlib.suppress(OSError):
                fd = os.open(tar.path, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
                finally:
                    os.close(fd)

    def done(self, local: str) -> None:
        """The reader has finished with ``local``: delete it if it is a downloaded copy."""
        if self.s3:
            with contextlib.suppress(OSError):
                os.unlink(local)

    def close(self) -> None:
        """Stop the download pool; downloads not yet started are cancelled."""
        if self.pool is not None:
            self.pool.shutdown(cancel_futures=True)


def _download(url: str, dest: str) -> str:
    download(url, dest)
    return dest
