"""``sdforge.ingest.fetch_state.prepare_out_dir``: a shard folder this stage did not fetch (no fingerprint) is moved
aside, never emptied (issue 55's audit of deleting call sites); its own fetch from other inputs is replaced."""

from __future__ import annotations

import logging
from pathlib import Path

from sdforge.ingest import fetch_state


def _tree(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): b"<dir>" if p.is_dir() else p.read_bytes() for p in folder.rglob("*")}


def test_a_folder_without_the_fingerprint_is_moved_aside_whole(tmp_path, caplog):
    out = tmp_path / "shards/laion"
    (out / "mine").mkdir(parents=True)
    (out / "00000.tar").write_bytes(b"a tar someone copied here")
    (out / "mine/notes.txt").write_text("the user's")
    before = _tree(out)
    with caplog.at_level(logging.WARNING):
        assert fetch_state.prepare_out_dir(out, "fingerprint v1\n") is False
    [moved] = [p for p in out.parent.iterdir() if p.name.startswith("laion.moved-")]
    assert _tree(moved) == before  # every file kept, byte for byte
    assert [p.name for p in out.iterdir()] == [fetch_state.FINGERPRINT_FILE]
    assert f"moved to {moved}" in caplog.text and "did not fetch" in caplog.text


def test_its_own_fetch_from_other_inputs_is_emptied_and_nothing_moved(tmp_path):
    out = tmp_path / "shards/laion"
    assert fetch_state.prepare_out_dir(out, "fingerprint v1\n") is False
    (out / "00000.tar").write_bytes(b"fetched with v1")
    assert fetch_state.prepare_out_dir(out, "fingerprint v2\n") is False
    assert [p.name for p in out.iterdir()] == [fetch_state.FINGERPRINT_FILE]
    assert [p.name for p in out.parent.iterdir()] == ["laion"]
