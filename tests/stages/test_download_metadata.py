"""download_metadata: local copies by pattern, symlinks, the hub path (a fake hub cache, resumed), errors."""

from __future__ import annotations

import os
from pathlib import Path

import huggingface_hub
import pytest

from sdforge.config import Source
from sdforge.ingest import metadata
from sdforge.io import InputError
from stages import download_metadata


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
    assert metrics == {"files": len(expected), "bytes": size, "skipped_symlinks": 0}
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
    assert metadata.is_local(repo) is local


def test_symlinks_out_of_the_source_are_skipped_and_named_and_never_followed(tmp_path, caplog):
    repo = make_repo(tmp_path / "repo")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.parquet").write_bytes(b"secret")
    (outside / "x.parquet").write_bytes(b"x")
    (repo / "inside.parquet").symlink_to(repo / "sub" / "part-1.parquet")
    (repo / "escape.parquet").symlink_to(outside / "secret.parquet")
    (repo / "relative-escape.parquet").symlink_to(Path("..") / "outside" / "secret.parquet")
    (repo / "broken.parquet").symlink_to(repo / "missing.parquet")
    (repo / "linked-dir").symlink_to(outside, target_is_directory=True)
    (repo / "inner-dir").symlink_to(repo / "sub", target_is_directory=True)
    before = {p for p in tmp_path.rglob("*") if "out" not in p.relative_to(tmp_path).parts}
    out = tmp_path / "out"
    metrics = download_metadata.run(Source(kind="laion", repo=str(repo), allow_patterns=["*.parquet"]), out)
    copied = sorted(p.relative_to(out).as_posix() for p in out.rglob("*"))
    assert copied == ["inside.parquet", "part-0.parquet", "sub", "sub/part-1.parquet"]
    assert not any(p.is_symlink() for p in out.rglob("*"))
    assert (out / "inside.parquet").read_bytes() == b"b" * 20
    assert metrics == {"files": 3, "bytes": 50, "skipped_symlinks": 4}
    for name in ("escape.parquet", "relative-escape.parquet", "broken.parquet", "linked-dir"):
        assert str(repo / name) in caplog.text
    assert "skipped 4 symlink(s)" in caplog.text and "inner-dir" not in caplog.text
    assert {p for p in tmp_path.rglob("*") if "out" not in p.relative_to(tmp_path).parts} == before


def test_copy_refuses_a_destination_outside_the_output(tmp_path):
    root = tmp_path / "root"
    (root / "a").mkdir(parents=True)
    (root / "a" / "f.parquet").write_bytes(b"f")
    out = tmp_path / "out"
    out.mkdir()
    (out / "a").symlink_to(tmp_path / "elsewhere", target_is_directory=True)  # a hostile pre-existing link
    with pytest.raises(InputError, match="would be outside"):
        metadata.copy_files(root, [root / "a" / "f.parquet"], out)
    assert not (tmp_path / "elsewhere").exists()


class FakeHub:
    """``snapshot_download`` over a hub-style cache: ``<cache>/datasets--o--n/{blobs,snapshots/<commit>}``.

    Like the real one, a file whose blob is already in the cache is not fetched again; ``fail_after``
    makes a call die after that many fetches (a killed download).
    """

    COMMIT = "c0ffee"

    def __init__(self, files: dict[str, bytes]):
        self.files, self.calls, self.fetched, self.fail_after = files, [], [], None

    def __call__(self, **kwargs):
        self.calls.append(kwargs)
        assert kwargs["cache_dir"], "the stage must name the cache (a test must not touch ~/.cache)"
        cache = Path(kwargs["cache_dir"])
        repo = cache / f"datasets--{kwargs['repo_id'].replace('/', '--')}"
        snapshot = repo / "snapshots" / self.COMMIT
        for n, (rel, data) in enumerate(sorted(self.files.items())):
            blob = repo / "blobs" / f"etag-{n}"
            if not blob.exists():
                if self.fail_after is not None and len(self.fetched) >= self.fail_after:
                    raise ConnectionError("killed mid-download")
                blob.parent.mkdir(parents=True, exist_ok=True)
                blob.write_bytes(data)
                self.fetched.append(rel)
            link = snapshot / rel
            link.parent.mkdir(parents=True, exist_ok=True)
            if not link.is_symlink():
                link.symlink_to(os.path.relpath(blob, link.parent))
        return str(snapshot)


def hub_error(cls, message: str):
    """A hub error without an HTTP response (its ``__init__`` wants one)."""
    err = cls.__new__(cls)
    Exception.__init__(err, message)
    return err


def test_hub_repo_goes_through_the_hub_cache_and_out_comes_only_the_matching_files(tmp_path, monkeypatch):
    hub = FakeHub({"data/part-00000.parquet": b"p" * 5, "data/part-00001.parquet": b"q" * 7})
    monkeypatch.setattr(huggingface_hub, "snapshot_download", hub)
    out, cache = tmp_path / "out", tmp_path / "hub-cache"
    source = Source(kind="laion", repo="owner/dataset", revision="abc123", cache_dir=str(cache))
    assert download_metadata.run(source, out) == {"files": 2, "bytes": 12, "skipped_symlinks": 0}
    assert hub.calls == [
        {
            "repo_id": "owner/dataset",
            "repo_type": "dataset",
            "revision": "abc123",
            "allow_patterns": ["*.parquet"],
            "cache_dir": str(cache),
        }
    ]
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()) == [
        "data/part-00000.parquet",
        "data/part-00001.parquet",
    ]
    assert (out / "data" / "part-00001.parquet").read_bytes() == b"q" * 7
    assert not any(p.is_symlink() for p in out.rglob("*")) and not (out / ".cache").exists()
    assert len(list((cache / "datasets--owner--dataset" / "blobs").iterdir())) == 2  # the cache is kept


@pytest.mark.parametrize(
    ("configured", "env", "expected"), [("/cfg", "/env", "/cfg"), (None, "/env", "/env"), (None, None, None)]
)
def test_hub_cache_dir_is_the_configured_one_else_hf_hub_cache(monkeypatch, configured, env, expected):
    if env is None:
        monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    else:
        monkeypatch.setenv("HF_HUB_CACHE", env)
    source = Source(kind="laion", repo="owner/dataset", cache_dir=configured)
    assert metadata.hub_cache_dir(source) == expected


def test_a_killed_hub_download_resumes_without_fetching_the_finished_files_again(tmp_path, monkeypatch):
    files = {f"data/part-{i:05d}.parquet": bytes([i]) * (i + 1) for i in range(4)}
    hub = FakeHub(files)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", hub)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    source = Source(kind="laion", repo="owner/dataset")
    out = tmp_path / "out"
    hub.fail_after = 2
    with pytest.raises(ConnectionError):
        download_metadata.run(source, out)
    assert hub.fetched == ["data/part-00000.parquet", "data/part-00001.parquet"]
    hub.fail_after = None
    metrics = download_metadata.run(source, out)  # what `dvc repro` / a Prefect retry does (out/ emptied first)
    assert hub.fetched[2:] == ["data/part-00002.parquet", "data/part-00003.parquet"]
    assert [call["cache_dir"] for call in hub.calls] == [str(tmp_path / "hub-cache")] * 2
    assert metrics == {"files": 4, "bytes": 10, "skipped_symlinks": 0}
    assert {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*") if p.is_file()} == files


def test_a_hub_snapshot_link_out_of_the_repo_cache_is_skipped(tmp_path, monkeypatch):
    hub = FakeHub({"data/part-00000.parquet": b"p" * 5})
    outside = tmp_path / "outside.parquet"
    outside.write_bytes(b"not from the hub")

    def tampered(**kwargs):
        snapshot = Path(hub(**kwargs))
        (snapshot / "data" / "evil.parquet").symlink_to(outside)
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", tampered)
    source = Source(kind="laion", repo="owner/dataset", cache_dir=str(tmp_path / "cache"))
    metrics = download_metadata.run(source, tmp_path / "out")
    assert metrics == {"files": 1, "bytes": 5, "skipped_symlinks": 1}
    assert not (tmp_path / "out" / "data" / "evil.parquet").exists()


@pytest.mark.parametrize("error", ["RepositoryNotFoundError", "RevisionNotFoundError", "GatedRepoError"])
def test_a_missing_hub_repo_or_revision_is_an_input_error_naming_it(tmp_path, monkeypatch, error):
    from huggingface_hub import errors

    def missing(**kwargs):
        raise hub_error(getattr(errors, error), "404 Client Error")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", missing)
    source = Source(kind="laion", repo="owner/nope", revision="v9", cache_dir=str(tmp_path / "cache"))
    with pytest.raises(InputError, match=r"hub dataset 'owner/nope' \(revision 'v9'\) not found or not accessible"):
        download_metadata.run(source, tmp_path / "out")


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
