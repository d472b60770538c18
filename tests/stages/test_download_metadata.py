"""download_metadata: local copies by pattern, the hub path (faked), and errors naming the repo."""

from __future__ import annotations

from pathlib import Path

import huggingface_hub
import pytest

from stages import download_metadata
from stages.common import InputError
from stages.config import Source


def make_repo(root: Path) -> Path:
    """A local 'dataset repo' with matching and non-matching files."""
    files = {
        "part-0.parquet": b"a" * 10,
        "sub/part-1.parquet": b"b" * 20,
        "README.md": b"readme",
        "archives/part-000001.zip": b"z" * 7,
    }
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return root


@pytest.mark.parametrize(
    ("patterns", "expected", "size"),
    [
        (["*.parquet"], ["part-0.parquet", "sub/part-1.parquet"], 30),
        (["*.zip"], ["archives/part-000001.zip"], 7),
        (["sub/*", "*.md"], ["README.md", "sub/part-1.parquet"], 26),
    ],
)
def test_local_repo_copies_only_matching_files(tmp_path, patterns, expected, size):
    repo = make_repo(tmp_path / "repo")
    out = tmp_path / "out"
    (out / "stale").mkdir(parents=True)
    (out / "stale" / "old.parquet").write_bytes(b"old")
    source = Source(kind="laion", repo=str(repo), allow_patterns=patterns)
    metrics = download_metadata.run(source, out)
    copied = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert copied == expected
    assert metrics == {"files": len(expected), "bytes": size}
    assert (out / expected[0]).read_bytes() == (repo / expected[0]).read_bytes()


def test_missing_local_repo_is_an_input_error_naming_it(tmp_path):
    missing = tmp_path / "no" / "such" / "repo"
    with pytest.raises(InputError, match=str(missing)):
        download_metadata.run(Source(kind="laion", repo=str(missing)), tmp_path / "out")


def test_no_matching_file_is_an_input_error_naming_repo_and_patterns(tmp_path):
    repo = make_repo(tmp_path / "repo")
    source = Source(kind="diffusiondb", repo=str(repo), allow_patterns=["*.tar"])
    with pytest.raises(InputError, match=r"repo.*no files matching allow_patterns \['\*\.tar'\]"):
        download_metadata.run(source, tmp_path / "out")


@pytest.mark.parametrize(
    ("repo", "local"),
    [
        ("laion/laion2B-en-aesthetic", False),
        ("poloclub/diffusiondb", False),
        ("data/demo_source/laion", True),
        ("./mirror", True),
        ("/abs/mirror", True),
        ("mirror", True),
    ],
)
def test_local_or_hub(repo, local):
    assert download_metadata.is_local(repo) is local


def test_hub_repo_uses_snapshot_download(tmp_path, monkeypatch):
    calls = []

    def fake_snapshot_download(**kwargs):
        calls.append(kwargs)
        local_dir = Path(kwargs["local_dir"])
        (local_dir / "data").mkdir(parents=True)
        (local_dir / "data" / "part-00000.parquet").write_bytes(b"p" * 5)
        (local_dir / ".cache" / "huggingface").mkdir(parents=True)
        (local_dir / ".cache" / "huggingface" / "x.parquet").write_bytes(b"meta")
        return str(local_dir)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    out = tmp_path / "out"
    source = Source(kind="laion", repo="owner/dataset", revision="abc123", allow_patterns=["*.parquet"])
    assert download_metadata.run(source, out) == {"files": 1, "bytes": 5}
    assert calls == [
        {
            "repo_id": "owner/dataset",
            "repo_type": "dataset",
            "revision": "abc123",
            "allow_patterns": ["*.parquet"],
            "local_dir": out,
        }
    ]
    assert not (out / ".cache").exists()


def test_demo_sources(demo_params, run_until):
    metrics = run_until(demo_params, "download_metadata")
    assert metrics["download_metadata@laion"]["files"] == 1
    assert metrics["download_metadata@diffusiondb"]["files"] == 1
    assert (Path(demo_params.paths.metadata) / "laion" / "part-00000.parquet").is_file()
    assert (Path(demo_params.paths.metadata) / "diffusiondb" / "part-000001.zip").is_file()


def test_cli_bad_repo_exits_2_with_the_repo_named(demo_params, tmp_path, caplog):
    import yaml

    data = yaml.safe_load((tmp_path / "params.yaml").read_text())
    data["sources"]["laion"]["repo"] = "./nowhere/laion"
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(SystemExit) as exc:
        download_metadata.main(["--params", str(tmp_path / "bad.yaml"), "--item", "laion"])
    assert exc.value.code == 2
    assert "./nowhere/laion" in caplog.text
