"""The DVC remote on S3 (a real moto server): configure from params, push each stage, and a fresh clone
that restores the pushed stages instead of rerunning them — including ``cache: false`` metrics, which
``dvc push --run-cache`` alone leaves behind."""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from flows.dvc_ops.dag import upstream_stages
from flows.dvc_ops.remote import configure_remote, default_remote, push_stage, restore_stage, sync_run_cache
from flows.dvc_ops.runner import run_dvc_stage
from sdforge.config import Storage, load_params
from tests.flows.conftest import fresh_clone, make_remote_project, ran_here


def test_storage_section_validates_urls_and_refuses_credentials():
    assert Storage().dvc_remote is None
    with pytest.raises(ValueError, match="s3://bucket/prefix"):
        Storage(dvc_remote="/mnt/data")
    with pytest.raises(ValueError, match="must not carry credentials"):
        Storage(endpoint_url="http://key:secret@minio:9000")
    with pytest.raises(ValueError, match="aws_secret_access_key"):
        Storage(aws_secret_access_key="x")  # unknown key: no place for a credential


def test_configure_writes_the_remote_to_config_local_only(tmp_path, moto_s3):
    project = make_remote_project(tmp_path / "project", moto_s3)
    config = (project / ".dvc/config").read_text()
    assert configure_remote(project, load_params(project / "params.yaml").storage)
    assert default_remote(project) == "storage"
    local = (project / ".dvc/config.local").read_text()
    assert moto_s3.url("dvcstore") in local and moto_s3.endpoint in local
    assert (project / ".dvc/config").read_text() == config  # the committed config is untouched
    assert "testing" not in local and "secret" not in local.lower()
    assert not configure_remote(project, Storage())  # no remote in params: nothing changes


def test_fresh_clone_restores_pushed_stages_instead_of_rerunning(tmp_path, moto_s3):
    """Push after each stage; a clone with only git restores both stages (metrics included), runs nothing."""
    project = make_remote_project(tmp_path / "project", moto_s3)
    storage = load_params(project / "params.yaml").storage
    configure_remote(project, storage)
    stages = upstream_stages(project, "mix_phase@phase1")
    assert stages == ["prepare", "mix_phase@phase1"]
    t0 = time.monotonic()
    for stage in stages:
        assert run_dvc_stage(project, stage, log_line=lambda _: None).status == "ran"
        assert push_stage(project, stage) >= 2  # the output and its metrics object (+ run-cache entry)
    pushed_s = time.monotonic() - t0
    assert ran_here(project) == stages

    clone = fresh_clone(project, tmp_path / "pod")
    t0 = time.monotonic()
    configure_remote(clone, storage)
    assert sync_run_cache(clone) == 2
    statuses = []
    for stage in stages:
        pulled = restore_stage(clone, stage)
        statuses.append((pulled, run_dvc_stage(clone, stage, log_line=lambda _: None).status))
    restored_s = time.monotonic() - t0
    assert statuses == [("pulled", "restored"), ("pulled", "restored")]
    assert ran_here(clone) == []  # no stage command ran on the new pod
    assert (clone / "mix-phase1.txt").read_text() == "prepared\nmix phase1\n"
    assert json.loads((clone / "metrics/mix_phase/phase1.json").read_text()) == {"samples": 3}
    assert restore_stage(clone, "prepare") == "current"
    print(f"run+push 2 stages {pushed_s:.1f} s; fresh clone restore {restored_s:.1f} s")


def test_fresh_clone_restores_a_stage_with_persistent_outputs(tmp_path, moto_s3):
    """DVC's run cache skips stages with ``persist: true`` outputs (fetch_images, encode_latents); the
    pushed ``dvc.lock`` entry restores them on a fresh clone, metrics included, and DVC then skips them."""
    project = make_remote_project(tmp_path / "project", moto_s3)
    dvc_yaml = project / "dvc.yaml"
    text = dvc_yaml.read_text()
    persistent = text.replace("outs: [prepared.txt]", "outs:\n      - prepared.txt:\n          persist: true", 1)
    assert persistent != text
    dvc_yaml.write_text(persistent)
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "persist"], cwd=project)
    storage = load_params(project / "params.yaml").storage
    configure_remote(project, storage)
    stages = ["prepare", "mix_phase@phase1"]
    for stage in stages:
        assert run_dvc_stage(project, stage, log_line=lambda _: None).status == "ran"
        push_stage(project, stage)

    clone = fresh_clone(project, tmp_path / "pod")
    configure_remote(clone, storage)
    sync_run_cache(clone)
    statuses = [(restore_stage(clone, s), run_dvc_stage(clone, s, log_line=lambda _: None).status) for s in stages]
    assert statuses == [("pulled", "skipped"), ("pulled", "restored")]
    assert ran_here(clone) == []
    for name in ("prepared.txt", "metrics/prepare.json", "mix-phase1.txt"):
        assert (clone / name).read_bytes() == (project / name).read_bytes(), name

    # a clone whose code differs from the pushed run's: the entry is not taken, and the dvc.lock written to try it
    # is put back as it was (removed when there was none: the only thing this path deletes)
    other = fresh_clone(project, tmp_path / "pod2")
    configure_remote(other, storage)
    (other / "fake_stage.py").write_text((other / "fake_stage.py").read_text() + "# changed\n")
    lock = other / "dvc.lock"
    before = lock.read_bytes() if lock.exists() else None
    assert restore_stage(other, "prepare") == "absent"
    assert (lock.read_bytes() if lock.exists() else None) == before
