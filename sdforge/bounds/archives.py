"""Compressed side files read within bounds: how many bytes a file may inflate to, in all and relative to its
size on disk (``sources.<s>.inputs.archive_max_bytes`` / ``archive_max_ratio``), and how long one line of a
JSON-lines stream may be (``json_max_bytes``) — so a gzip bomb stops after a bounded read, and a line with no end
costs a bounded buffer, not the whole stream."""

from __future__ import annotations

import gzip
import io
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from sdforge.config import InputLimits

MIN_INFLATED_BYTES = 64 << 20
"""A small file may always inflate this far, whatever its ratio (a 1 KB gzip of a short JSONL is fine)."""


class ArchiveLimitError(ValueError):
    """A compressed file that inflates past its bound; the message names the file, the bound and the key."""


def inflate_limit(compressed_bytes: int, limits: InputLimits) -> int:
    """How many bytes a file of ``compressed_bytes`` on disk may inflate to."""
    by_ratio = max(limits.archive_max_ratio * compressed_bytes, MIN_INFLATED_BYTES)
    return min(limits.archive_max_bytes, by_ratio)


class BoundedReader(io.RawIOBase):
    """Reads ``inner`` and raises :class:`ArchiveLimitError` once more than ``limit`` bytes came out of it."""

    def __init__(self, inner: BinaryIO, limit: int, what: str, limits: InputLimits, owned: tuple = ()):
        self.inner, self.limit, self.what, self.limits, self.count = inner, limit, what, limits, 0
        self.owned = (inner, *owned)

    def readable(self) -> bool:
        return True

    def close(self) -> None:
        for fh in self.owned:
            fh.close()
        super().close()

    def readinto(self, buffer) -> int:
        data = self.inner.read(len(buffer))
        self.count += len(data)
        if self.count > self.limit:
            raise ArchiveLimitError(
                f"{self.what}: inflates past {self.limit:,} bytes (sources.<source>.inputs.archive_max_ratio "
                f"{self.limits.archive_max_ratio} × its size, at most archive_max_bytes "
                f"{self.limits.archive_max_bytes:,}): a decompression bomb, or raise them if the file is genuine"
            )
        buffer[: len(data)] = data
        return len(data)


def open_inflated(path: Path, limits: InputLimits) -> BinaryIO:
    """``path``'s bytes, gunzipped when it is gzip, through a :class:`BoundedReader` (close it when done)."""
    raw = path.open("rb")
    gzipped = raw.read(2) == b"\x1f\x8b"
    raw.seek(0)
    inner = gzip.GzipFile(fileobj=raw) if gzipped else raw
    reader = BoundedReader(inner, inflate_limit(path.stat().st_size, limits), str(path), limits, owned=(raw,))
    return io.BufferedReader(reader, 1 << 20)


def bounded_lines(fh: BinaryIO, max_line: int) -> Iterator[bytes | None]:
    """The non-blank lines of ``fh``, each read with at most ``max_line`` + 1 bytes buffered; a longer line is
    skipped to its end in bounded chunks and yields None (the caller counts it)."""
    while line := fh.readline(max_line + 1):
        if len(line) > max_line and not line.endswith(b"\n"):
            while (rest := fh.readline(1 << 20)) and not rest.endswith(b"\n"):
                pass
            yield None
        elif line.strip():
            yield line
