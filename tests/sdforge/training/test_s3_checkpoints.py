"""S3 checkpoints against a real moto server: upload order, multipart, partial uploads, newest of local/S3,
remote retention, and a fresh pod (empty runs dir) resuming from S3 to bit-identical weights."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
import yaml

from sdforge.training.checkpoints import COMPLETE, Retention, _file_table, checkpoint_dirs
from sdforge.training.resume import resume_point
from sdforge.training.s3_checkpoints import BackgroundUploader, RemoteRun, run_url, split_s3_url
from tests.fixtures.checkpoints import save

FINGERPRINT = "0123456789abcdef"
"""The run's input fingerprint: its remote folder is ``ckpts/<phase>/<fingerprint>/``."""
PREFIX = f"ckpts/phase1/{FINGERPRINT}"


def remote_for(moto_s3, run_dir, **kwargs) -> RemoteRun:
    return RemoteRun(run_url(moto_s3.url("ckpts"), run_dir.name, FINGERPRINT), **kwargs)


def keys(moto_s3, prefix: str = "") -> list[str]:
    listing = moto_s3.client.list_objects_v2(Bucket=moto_s3.bucket, Prefix=prefix)
    return sorted(o["Key"] for o in listing.get("Contents", []))


def test_split_url():
    assert split_s3_url("s3://b/a/b/") == ("b", "a/b")
    assert split_s3_url("s3://b") == ("b", "")
    with pytest.raises(ValueError, match="s3://bucket/prefix"):
        split_s3_url("/local/path")


def test_boto3_honours_aws_endpoint_url(moto_s3):
    import boto3

    assert boto3.client("s3").meta.endpoint_url == moto_s3.endpoint


def test_upload_marker_last_and_download_roundtrip(moto_s3, tmp_path):
    run_dir = tmp_path / "runs/phase1"
    ckpt = save(run_dir, 4, loss=0.5, world=2)
    remote = remote_for(moto_s3, run_dir)
    order: list[str] = []
    upload = remote.s3.upload_file
    remote.s3.upload_file = lambda path, bucket, key, **kw: (order.append(key), upload(path, bucket, key, **kw))
    assert remote.upload(ckpt) == f"s3://{moto_s3.bucket}/{PREFIX}/checkpoint-00000004"
    assert order[-1] == f"{PREFIX}/checkpoint-00000004/COMPLETE" and len(order) == 7
    [found] = remote.complete()
    assert (found.step, found.manifest["loss"], found.manifest["world"]) == (4, 0.5, 2)
    fresh = tmp_path / "fresh/phase1"
    got = remote.download(found, fresh)
    for f in (p for p in ckpt.rglob("*") if p.is_file()):
        assert (got / f.relative_to(ckpt)).read_bytes() == f.read_bytes()
    assert not list(fresh.glob("*.download"))


def test_large_files_go_multipart(moto_s3, tmp_path):
    run_dir = tmp_path / "phase1"
    ckpt = save(run_dir, 1)
    big = ckpt / "big.bin"
    big.write_bytes(bytes(range(256)) * (6 * 2**20 // 256))  # 6 MiB: 2 parts (S3 parts are ≥ 5 MiB)
    manifest = json.loads((ckpt / COMPLETE).read_text())
    manifest["files"] = _file_table(ckpt)
    (ckpt / COMPLETE).write_text(json.dumps(manifest))
    remote = remote_for(moto_s3, run_dir, multipart_threshold=2**20)
    remote.upload(ckpt)
    head = moto_s3.client.head_object(Bucket=moto_s3.bucket, Key=f"{PREFIX}/checkpoint-00000001/big.bin")
    assert head["ETag"].strip('"').endswith("-2")  # the ETag of a 2-part multipart upload
    small = moto_s3.client.head_object(Bucket=moto_s3.bucket, Key=f"{PREFIX}/checkpoint-00000001/state.pt")
    assert "-" not in small["ETag"]
    got = remote.download(remote.newest(), tmp_path / "fresh/phase1")
    assert (got / "big.bin").read_bytes() == big.read_bytes()


def test_partial_upload_is_ignored(moto_s3, tmp_path):
    run_dir = tmp_path / "phase1"
    remote = remote_for(moto_s3, run_dir)
    remote.upload(save(run_dir, 1))
    second = save(run_dir, 2)
    upload = remote.s3.upload_file

    def killed_before_marker(path, bucket, key, **kw):
        if key.endswith(COMPLETE):
            raise ConnectionError("pod killed")
        upload(path, bucket, key, **kw)

    remote.s3.upload_file = killed_before_marker
    with pytest.raises(ConnectionError):
        remote.upload(second)
    assert any(k.startswith(f"{PREFIX}/checkpoint-00000002/") for k in keys(moto_s3))
    assert [c.step for c in remote.complete()] == [1]
    fresh = tmp_path / "fresh/phase1"
    ckpt, state = resume_point(fresh, remote=run_url(moto_s3.url("ckpts"), fresh.name, FINGERPRINT))
    assert ckpt == fresh / "checkpoint-00000001" and state["v"].item() == 1


def test_newest_of_local_and_s3(moto_s3, tmp_path, caplog):
    run_dir = tmp_path / "phase1"
    remote = remote_for(moto_s3, run_dir)
    for step in (1, 3):
        remote.upload(save(tmp_path / "elsewhere/phase1", step))
    save(run_dir, 2)
    with caplog.at_level(logging.INFO):
        ckpt, state = resume_point(run_dir, remote=run_url(moto_s3.url("ckpts"), run_dir.name, FINGERPRINT))
    assert ckpt.name == "checkpoint-00000003" and state["v"].item() == 3  # S3 is newer: downloaded
    assert "resuming from s3://" in caplog.text
    assert [p.name for p in checkpoint_dirs(run_dir)] == ["checkpoint-00000002", "checkpoint-00000003"]
    save(run_dir, 4)
    ckpt, _ = resume_point(run_dir, remote=run_url(moto_s3.url("ckpts"), run_dir.name, FINGERPRINT))
    assert ckpt.name == "checkpoint-00000004"  # local is newer


def test_corrupt_remote_falls_back(moto_s3, tmp_path, caplog):
    run_dir = tmp_path / "phase1"
    remote = remote_for(moto_s3, run_dir)
    for step in (1, 2):
        remote.upload(save(tmp_path / "elsewhere/phase1", step))
    key = f"{PREFIX}/checkpoint-00000002/state.pt"
    body = bytearray(moto_s3.client.get_object(Bucket=moto_s3.bucket, Key=key)["Body"].read())
    body[len(body) // 2] ^= 0xFF
    moto_s3.client.put_object(Bucket=moto_s3.bucket, Key=key, Body=bytes(body))
    with caplog.at_level(logging.WARNING):
        ckpt, state = resume_point(run_dir, remote=run_url(moto_s3.url("ckpts"), run_dir.name, FINGERPRINT))
    assert ckpt.name == "checkpoint-00000001" and state["v"].item() == 1
    assert "state.pt does not match its sha256" in caplog.text
    assert not (run_dir / "checkpoint-00000002").exists()


def test_background_uploads_mirror_retention(moto_s3, tmp_path):
    run_dir = tmp_path / "phase1"
    run_dir.mkdir()
    (run_dir / "fingerprint.txt").write_text("abc\n")
    rule = Retention(keep_last=2, keep_every=3, keep_best=True)
    remote = remote_for(moto_s3, run_dir)
    remote.upload(save(tmp_path / "other/phase1", 9))  # a checkpoint from other inputs (no fingerprint)
    uploader = BackgroundUploader(remote, run_dir, rule, sync=False)
    for step, loss in {1: 0.5, 2: 0.4, 3: 0.6, 4: 0.7, 5: 0.8, 6: 0.9}.items():
        uploader.submit(save(run_dir, step, loss, rule=rule))
    uploader.close()
    assert [c.step for c in remote.complete()] == [2, 3, 5, 6, 9]  # pruning never deletes another run's copy
    assert [p.name for p in checkpoint_dirs(run_dir)] == [f"checkpoint-0000000{s}" for s in (2, 3, 5, 6)]
    assert not list((run_dir / ".upload").iterdir()) and uploader.failed == 0


def test_uploads_copy_when_hard_links_fail_and_the_spool_is_emptied(moto_s3, tmp_path, monkeypatch):
    """A file system without hard links: the half-linked snapshot is removed and copied whole instead (the spool is
    the uploader's own); the local checkpoint is untouched and the remote one complete."""
    run_dir = tmp_path / "phase1"
    run_dir.mkdir()
    (run_dir / "fingerprint.txt").write_text("abc\n")
    ckpt = save(run_dir, 1, 0.5)
    before = {p.name: p.read_bytes() for p in ckpt.iterdir() if p.is_file()}

    def no_links(src, dst, **kwargs):
        raise OSError(1, "Operation not permitted")

    monkeypatch.setattr("os.link", no_links)
    uploader = BackgroundUploader(remote_for(moto_s3, run_dir), run_dir, Retention(keep_last=2), sync=True)
    uploader.submit(ckpt)
    uploader.close()
    assert uploader.failed == 0 and [c.step for c in uploader.remote.complete()] == [1]
    assert {p.name: p.read_bytes() for p in ckpt.iterdir() if p.is_file()} == before
    assert not list((run_dir / ".upload").iterdir())


# -- end to end: the train stage on a "fresh pod" ------------------------------------------------
def test_fresh_pod_resumes_from_s3_bit_identical(moto_s3, tmp_path, monkeypatch, straight_phase1):
    from tests.fixtures.training import train, untrained_clone, weights

    straight, pod = straight_phase1, tmp_path / "pod"
    pod.mkdir()
    p_pod = untrained_clone(straight, pod)
    data = yaml.safe_load(p_pod.read_text())
    data["train"]["checkpoint_s3"] = moto_s3.url("ckpts")
    p_pod.write_text(yaml.safe_dump(data))
    monkeypatch.setenv("SDFORGE_CHECKPOINT_UPLOAD", "sync")  # uploads finish before the kill
    died = train(p_pod, "phase1", kill_at=3)
    assert died.returncode == -9, died.stderr[-3000:]
    assert any(k.endswith("/checkpoint-00000002/COMPLETE") for k in keys(moto_s3, "ckpts/phase1/"))
    shutil.rmtree(pod / "runs")  # the pod is gone: a new one starts with an empty runs dir
    monkeypatch.delenv("SDFORGE_CHECKPOINT_UPLOAD")  # background uploads: the run must wait for them at exit
    resumed = train(p_pod, "phase1")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from s3://" in resumed.stderr and "at step 2 (epoch 0, step 2 of it)" in resumed.stderr
    for sub in ("unet", "unet_ema"):
        a, b = weights(straight, "phase1", sub), weights(pod, "phase1", sub)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), f"{sub} differs after S3 resume"
    steps = [int(k.split("/")[3].removeprefix("checkpoint-")) for k in keys(moto_s3) if k.endswith(COMPLETE)]
    assert {4, 6} <= set(steps) and len(steps) <= 3  # keep_last=2 (+ the best) mirrored on S3
