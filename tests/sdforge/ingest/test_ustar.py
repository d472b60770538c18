"""sdforge.ingest.ustar: header fields, checksums and member names, checked against what Python's tarfile writes."""

from __future__ import annotations

import io
import tarfile

import pytest

from sdforge.ingest import shards, ustar
from sdforge.ingest.ustar import BLOCK, END_BLOCK, TarDamaged, parse_header
from sdforge.latents.inputs import iter_tar_members

LONG = "a" * 60 + "/" + "b" * 70 + "/0001.jpg"
"""150 characters: a GNU long name or pax path, or (split at a slash) a ustar prefix and name."""


def tar_of(members: dict[str, bytes], fmt: int, **info) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt, encoding="utf-8") as tar:
        for name, data in members.items():
            member = tarfile.TarInfo(name)
            member.size = len(data)
            for key, value in info.items():
                setattr(member, key, value)
            tar.addfile(member, io.BytesIO(data))
    return buf.getvalue()


def walk(raw: bytes) -> list[tuple[bytes, bytes, bytes]]:
    """``(type, name, data)`` per header of ``raw``, names resolved by GNU long name / pax path as the readers do."""
    out, pos, pending = [], 0, None
    while raw[pos : pos + BLOCK] != END_BLOCK:
        size, kind, name = parse_header(raw[pos : pos + BLOCK])
        data = raw[pos + BLOCK : pos + BLOCK + size]
        pos += BLOCK + size + -size % BLOCK
        if kind == ustar.GNU_LONG_NAME:
            pending = ustar.long_name(data)
        elif kind == ustar.PAX_HEADER:
            pending = ustar.pax_records(data).get(b"path", pending)
        else:
            out.append((kind, name if pending is None else pending, data))
            pending = None
    return out


@pytest.mark.parametrize(
    ("field", "digits", "expected"),
    [
        (b"0000644\0", 7, 0o644),  # what tarfile writes: digits, NUL
        (b"00000001750 ", 11, 1000),  # GNU tar's size field: digits, space
        (b"012345\0 ", 6, 0o12345),  # a checksum field: six digits, NUL, space
        (b"1750\0\0\0\0\0\0\0\0", 11, 1000),  # short digits, NUL-padded (not the fast path)
        (b"  1750 \0\0\0\0\0", 11, 1000),  # space-padded
        (b"\0" * 12, 11, 0),  # empty
        (b"\x80" + (8**11 + 5).to_bytes(11, "big"), 11, 8**11 + 5),  # GNU base-256
    ],
)
def test_number_reads_octal_and_base256_fields(field, digits, expected):
    assert ustar.number(field, digits) == expected


def test_number_rejects_non_octal():
    with pytest.raises(ValueError):
        ustar.number(b"00000009999\0", 11)


def test_size_of_8_gib_and_more_is_read_from_gnu_base256():
    member = tarfile.TarInfo("huge.bin")
    member.size = 8**11 + 5  # one past ustar's 11 octal digits: tarfile writes base-256
    header = member.tobuf(tarfile.GNU_FORMAT)
    assert header[124] == 0x80
    assert parse_header(header) == (8**11 + 5, b"0", b"huge.bin")


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
def test_short_names_sizes_and_types_match_tarfile(fmt):
    members = {"0001.jpg": b"x" * 700, "0001.txt": b"caption", "0002.json": b"", "0003.jpg": b"y" * 512}
    raw = tar_of(members, fmt)
    tar = tarfile.open(fileobj=io.BytesIO(raw))
    assert [(t[1].decode(), t[2]) for t in walk(raw)] == [(m.name, tar.extractfile(m).read()) for m in tar]
    assert {t[0] for t in walk(raw)} == {b"0"}


def test_ustar_prefix_is_joined_to_the_name():
    raw = tar_of({LONG: b"data"}, tarfile.USTAR_FORMAT)
    assert raw[345:406] == b"a" * 60 + b"\0"  # tarfile split the name: prefix ...
    assert raw[:80] == b"b" * 70 + b"/0001.jpg\0"  # ... and the name
    assert walk(raw) == [(b"0", LONG.encode(), b"data")]
    assert tarfile.open(fileobj=io.BytesIO(raw)).getnames() == [LONG]


def test_gnu_long_name_replaces_the_truncated_one():
    raw = tar_of({LONG: b"data"}, tarfile.GNU_FORMAT)
    size, kind, _ = parse_header(raw[:BLOCK])
    assert (kind, size) == (ustar.GNU_LONG_NAME, len(LONG) + 1)  # the name and its NUL
    assert ustar.long_name(raw[BLOCK : BLOCK + size]) == LONG.encode()
    assert walk(raw) == [(b"0", LONG.encode(), b"data")]
    assert tarfile.open(fileobj=io.BytesIO(raw)).getnames() == [LONG]


def test_pax_path_replaces_the_truncated_one_and_other_records_are_read():
    name = "é" * 110 + ".txt"  # non-ASCII and > 100 bytes: a pax path record
    raw = tar_of({name: b"caption"}, tarfile.PAX_FORMAT, mtime=1.5)
    size, kind, _ = parse_header(raw[:BLOCK])
    records = ustar.pax_records(raw[BLOCK : BLOCK + size])
    assert kind == ustar.PAX_HEADER
    assert records == {b"mtime": b"1.5", b"path": name.encode()}
    assert walk(raw) == [(b"0", name.encode(), b"caption")]
    assert tarfile.open(fileobj=io.BytesIO(raw)).getnames() == [name]


def test_pax_records_later_key_wins_and_zero_length_is_refused():
    assert ustar.pax_records(b"12 path=a/b\n12 path=c/d\n") == {b"path": b"c/d"}
    assert ustar.pax_records(b"") == {}
    with pytest.raises(ValueError, match="positive"):
        ustar.pax_records(b"0 path=x\n")
    with pytest.raises(ValueError):
        ustar.pax_records(b"no length\n")


def test_directory_type_and_empty_name_of_non_files():
    member = tarfile.TarInfo("some/dir")
    member.type = tarfile.DIRTYPE
    assert parse_header(member.tobuf(tarfile.USTAR_FORMAT)) == (0, ustar.DIRECTORY, b"")
    assert set(ustar.REGULAR_TYPES) == {tarfile.REGTYPE, tarfile.AREGTYPE, tarfile.CONTTYPE}


def test_an_unreadable_pax_header_is_damage():
    raw = bytearray(tar_of({"é" * 110 + ".txt": b"caption"}, tarfile.PAX_FORMAT))
    raw[BLOCK : BLOCK + 3] = b"zz "  # the first record's length
    with pytest.raises(TarDamaged, match="unreadable pax header"):
        list(iter_tar_members(io.BytesIO(bytes(raw))))
    assert shards._tar_index(bytes(raw)) is None  # shards' index leaves it to tarfile


def with_checksum(header: bytes, checksum: int) -> bytes:
    return header[:148] + b"%06o\0 " % checksum + header[156:]


def test_bad_checksum_is_damage():
    header = tar_of({"0001.txt": b"x"}, tarfile.USTAR_FORMAT)[:BLOCK]
    true_sum = tarfile.calc_chksums(header)[0]
    assert ustar.number(header[148:156], 6) == true_sum
    with pytest.raises(TarDamaged, match="bad header checksum"):
        parse_header(with_checksum(header, true_sum + 1))
    with pytest.raises(TarDamaged, match="bad header checksum"):
        parse_header(header[:200] + b"Z" + header[201:])  # a flipped byte
    with pytest.raises(TarDamaged, match="unreadable header fields"):
        parse_header(header[:124] + b"0000000001x\0" + header[136:])


def test_checksum_is_exact_above_adler32s_modulus():
    """A header whose byte sum passes 65521 (adler32's modulus): only the exact sum is accepted."""
    member = tarfile.TarInfo("ÿ" * 155 + "/" + "ÿ" * 100)  # latin-1 0xFF: a byte sum of ~80,000
    member.uname = member.gname = "ÿ" * 31
    header = member.tobuf(tarfile.USTAR_FORMAT, encoding="latin-1")
    true_sum = tarfile.calc_chksums(header)[0]
    assert true_sum > 65521
    assert parse_header(header) == (0, b"0", "ÿ".encode("latin-1") * 155 + b"/" + "ÿ".encode("latin-1") * 100)
    with pytest.raises(TarDamaged, match="bad header checksum"):
        parse_header(with_checksum(header, true_sum - 65521))


def test_both_readers_give_tarfiles_names(tmp_path):
    """encode_inputs' stream reader and shards' index read long names as tarfile does, whatever the format."""
    members = {LONG: b"x" * 700, "0002.txt": b"caption", "é" * 110 + ".json": b"{}"}
    for fmt in (tarfile.GNU_FORMAT, tarfile.PAX_FORMAT):
        raw = tar_of(members, fmt)
        assert dict(iter_tar_members(io.BytesIO(raw))) == members
        path = tmp_path / f"{fmt}.tar"
        path.write_bytes(raw)
        assert shards.read_tar(path) == shards._read_tar_slow(path)
        assert {f"{key}.{ext}" for key, exts in shards.read_tar(path).items() for ext in exts} == set(members)
