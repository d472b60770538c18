"""Reading the images that filtered rows name: tar members streamed, zip members and loose files at random.

Nothing is ever extracted to disk: member names are only looked up. A member is refused, with the
status the shard parquet records (:class:`MemberRejected`): ``unsafe_member`` (a tar symlink,
hardlink or device, a zip symlink, a name with ``..`` or absolute, a loose file or archive
resolving outside the source folder); ``duplicate`` (a name stored twice in its archive);
``too_large`` (over ``max_bytes``, checked before reading: ``fetch.max_image_pixels`` ×
:data:`~sdforge.bounds.images.MAX_BYTES_PER_PIXEL`); ``failed_to_download`` (missing, or an archive that is unreadable,
truncated or corrupt).
"""

from __future__ import annotations

import bz2
import contextlib
import gzip
import logging
import lzma
import stat
import tarfile
import zipfile
import zlib
from collections import Counter
from collections.abc import Generator, Iterator, Mapping
from pathlib import Path

from sdforge.bounds.images import MAX_BYTES_PER_PIXEL
from sdforge.ingest.sources.rows import inside, safe_member

log = logging.getLogger(__name__)

STREAM_SUFFIXES = (".tar", ".tgz", ".tar.gz", ".tar.bz2", ".tbz2", ".tar.xz", ".txz")
ZIP_SUFFIXES = (".zip",)

_READ_ERRORS = (
    tarfile.TarError, zipfile.BadZipFile, EOFError, OSError, zlib.error, lzma.LZMAError, NotImplementedError,
    RuntimeError,
)  # fmt: skip
_MAGIC = ((b"\x1f\x8b", gzip.open), (b"BZh", bz2.open), (b"\xfd7zXZ\x00", lzma.open))


def open_decompressed(path: Path):
    """``path`` as a binary stream, decompressed by its magic bytes (gzip, bzip2, xz; else as it is).

    tarfile's own ``r|*`` decompresses through a 10 KiB Python loop: a 10 GiB member that must be skipped to
    reach a good one behind it (it compresses to ~10 MB) took 9 min; through the C-level readers here a GiB
    takes ~2 s on a 2-core Xeon.
    """
    with path.open("rb") as fh:
        head = fh.read(6)
    for magic, opener in _MAGIC:
        if head.startswith(magic):
            return opener(path, "rb")
    return path.open("rb")


def is_stream_archive(archive: str | None) -> bool:
    return archive is not None and archive.lower().endswith(STREAM_SUFFIXES)


def archive_stem(archive: str) -> str:
    """``000`` for ``data/train/imgs/000.tgz``."""
    name = archive.rsplit("/", 1)[-1]
    for suffix in sorted(STREAM_SUFFIXES + ZIP_SUFFIXES, key=len, reverse=True):
        if name.lower().endswith(suffix):
            return name[: -len(suffix)]
    return name


class MemberRejected(Exception):
    """A member (or its archive) that is not read: ``status`` for the shard parquet, ``message`` why."""

    def __init__(self, status: str, message: str):
        super().__init__(message)
        self.status, self.message = status, message


def checked_file(root: Path, rel: str, what: str) -> Path:
    """``root / rel`` when it is a regular file inside ``root`` (symlinks followed), else :class:`MemberRejected`."""
    path = root / rel
    if not inside(path, root):
        raise MemberRejected("unsafe_member", f"{what} {rel} resolves outside the source folder")
    if not path.exists():
        raise MemberRejected("failed_to_download", f"{what} {rel} not found")
    if not stat.S_ISREG(path.stat().st_mode):
        raise MemberRejected("unsafe_member", f"{what} {rel} is not a regular file")
    return path


class RandomReader:
    """Bytes of zip members and loose files under ``root``, each checked before it is read."""

    def __init__(self, root: Path, max_bytes: int):
        self.root, self.max_bytes = root, max_bytes
        self.zips: dict[str, zipfile.ZipFile | MemberRejected] = {}
        self.zip_names: dict[str, Counter] = {}

    def close(self) -> None:
        for zf in self.zips.values():
            if isinstance(zf, zipfile.ZipFile):
                zf.close()

    def _zip(self, archive: str) -> zipfile.ZipFile:
        if archive not in self.zips:
            try:
                zf = zipfile.ZipFile(checked_file(self.root, archive, "archive"))
                self.zip_names[archive] = Counter(zf.namelist())
                self.zips[archive] = zf
            except MemberRejected as err:
                self.zips[archive] = err
            except (zipfile.BadZipFile, OSError) as err:
                self.zips[archive] = MemberRejected("failed_to_download", f"archive {archive} unreadable ({err})")
        zf = self.zips[archive]
        if isinstance(zf, MemberRejected):
            raise zf
        return zf

    def read(self, archive: str | None, member: str) -> bytes:
        """``member`` of the zip ``archive``, or the loose file ``member`` (``archive`` None)."""
        if archive is None:
            path = checked_file(self.root, member, "file")
            _check_bytes(path.stat().st_size, self.max_bytes)
            try:
                return path.read_bytes()
            except OSError as err:
                raise MemberRejected("failed_to_download", f"cannot read {member} ({err})") from None
        zf = self._zip(archive)
        try:
            info = zf.getinfo(member)
        except KeyError:
            raise MemberRejected("failed_to_download", "member not in archive") from None
        if stat.S_ISLNK(info.external_attr >> 16):
            raise MemberRejected("unsafe_member", "zip member is a symlink")
        if info.is_dir():
            raise MemberRejected("failed_to_download", "zip member is a directory")
        if self.zip_names[archive][member] > 1:
            raise MemberRejected("duplicate", "member name appears more than once in the archive")
        _check_bytes(info.file_size, self.max_bytes)
        try:
            return zf.read(info)
        except _READ_ERRORS as err:
            raise MemberRejected("failed_to_download", f"corrupt zip member ({type(err).__name__}: {err})") from None


def _check_bytes(size: int, max_bytes: int) -> None:
    if size > max_bytes:
        raise MemberRejected(
            "too_large", f"file of {size} bytes > {max_bytes} (fetch.max_image_pixels x {MAX_BYTES_PER_PIXEL})"
        )


def _tar_member_problem(info: tarfile.TarInfo) -> str | None:
    if info.issym():
        return "tar member is a symlink"
    if info.islnk():
        return "tar member is a hardlink"
    if not info.isreg():
        return "tar member is not a regular file"
    return None


def _close_quietly(tar: tarfile.TarFile) -> None:
    with contextlib.suppress(*_READ_ERRORS):
        tar.close()


def stream_tar(
    path: Path, archive: str, members: Mapping[str, object], max_bytes: int
) -> Iterator[tuple[str, bytes | MemberRejected]]:
    """Stream ``path`` once; yield ``(member, bytes or rejection)`` for the wanted ``members`` (its keys).

    A member is matched by its name without a leading ``./``, or prefixed with the archive's stem
    (``000.tgz`` holding ``x.jpg`` serves member ``000/x.jpg``). A member stored twice is yielded
    again as a ``duplicate`` rejection (which overrides the first). Read errors end the stream: the
    members not seen by then are yielded, last, as ``failed_to_download`` with the error.
    """
    seen: set[str] = set()
    error, unsafe_names = yield from _stream_wanted(path, archive_stem(archive), members, max_bytes, seen)
    if error:
        log.warning("%s: %s", archive, error)
    if unsafe_names:
        log.warning("%s: ignored %d members with unsafe names (absolute or '..')", archive, unsafe_names)
    for member in members:
        if member not in seen:
            yield member, MemberRejected("failed_to_download", error or "member not in archive")


_Streamed = Generator[tuple[str, bytes | MemberRejected], None, tuple[str | None, int]]


def _stream_wanted(path: Path, stem: str, members: Mapping[str, object], max_bytes: int, seen: set[str]) -> _Streamed:
    """Yield the wanted members in archive order, adding each to ``seen`` (a member whose read fails is
    left out); return the read error that ended the stream (or None) and the count of unsafe names."""
    try:
        stream = open_decompressed(path)
    except _READ_ERRORS as err:
        return f"archive unreadable ({type(err).__name__}: {err})", 0
    with stream:
        return (yield from _stream_members(stream, stem, members, max_bytes, seen))


def _stream_members(stream, stem: str, members: Mapping[str, object], max_bytes: int, seen: set[str]) -> _Streamed:
    """:func:`_stream_wanted` over an open, decompressed ``stream``."""
    try:
        tar = tarfile.open(fileobj=stream, mode="r|")
    except _READ_ERRORS as err:
        return f"archive unreadable ({type(err).__name__}: {err})", 0
    unsafe_names = 0
    while True:
        info, error = _next_header(tar, wanted_so_far=len(seen))
        if info is None:
            _close_quietly(tar)
            return error, unsafe_names
        name = safe_member(info.name)
        if name is None:
            unsafe_names += 1
            continue
        member = name if name in members else f"{stem}/{name}"
        if member not in members:
            continue
        if member in seen:
            yield member, MemberRejected("duplicate", "member appears more than once in the archive")
            continue
        seen.add(member)
        rejection = _member_rejection(info, max_bytes)
        if rejection:
            yield member, rejection
            continue
        try:
            data = _read_member(tar, info)
        except _READ_ERRORS as err:
            seen.discard(member)
            _close_quietly(tar)
            return f"archive unreadable at {info.name} ({type(err).__name__}: {err})", unsafe_names
        yield member, data


def _next_header(tar: tarfile.TarFile, wanted_so_far: int) -> tuple[tarfile.TarInfo | None, str | None]:
    """The next member's header and no error; ``(None, None)`` at the end; ``(None, error)`` when unreadable."""
    try:
        info = tar.next()
        tar.members = []  # streaming: keep no index of the archive in memory
    except _READ_ERRORS as err:
        return None, f"archive unreadable after {wanted_so_far} wanted members ({type(err).__name__}: {err})"
    return info, None


def _member_rejection(info: tarfile.TarInfo, max_bytes: int) -> MemberRejected | None:
    """Why a wanted member is not read (not a regular file, or over ``max_bytes``), or None."""
    problem = _tar_member_problem(info)
    if problem:
        return MemberRejected("unsafe_member", problem)
    if info.size > max_bytes:
        return MemberRejected("too_large", f"member of {info.size} bytes > {max_bytes}")
    return None


def _read_member(tar: tarfile.TarFile, info: tarfile.TarInfo) -> bytes:
    """The bytes of the regular member ``info``, the stream's current one; read errors propagate."""
    fh = tar.extractfile(info)
    assert fh is not None
    return fh.read()
