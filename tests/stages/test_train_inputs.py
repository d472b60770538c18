"""What a phase's weights depend on, through the train stage (in process, tiny workspace): a key that changes no
weight resumes the run bit-identically; a weight key moves the run dir aside — nothing under runs/ or on S3 is
deleted — and the phase retrains; ``sdforge runs`` lists and removes stale runs. (Changed models: test_train.py.)"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
import yaml

from sdforge.config import Effect, Phase, Train, keys_by_effect, load_params
from sdforge.training.run_dir import STALE_NOTE, stale_runs
from stages import train
from tests.fixtures.toy_job import CrashAfter
from tests.fixtures.training import clone_workspace, edit_params, tiny_params, untrained_clone, weights

CHANGES = {
    "train": {
        "save_steps": 3, "keep_last": 1, "keep_every": 2, "keep_best": False, "checkpoint_s3": "S3",
        "async_checkpoint": "off",
        "log_every": 3, "validation_every": 2, "validation_prompts": 2, "progress_bar": False,
        "val_loss_every": 2, "val_loss_timesteps": 4, "val_loss_batch": 8,  # measured: test_train_val_loss.py
        "preempt_grace_s": 40.0, "hang_timeout_s": 900.0,
        "rdzv_endpoint": "127.0.0.1:29999",  # a job-shape key that one process can change (no launch)
        "activation_checkpointing": "selective",  # no budget on a CPU: the 64x64 level recomputed, bit-identical
        "memory_budget_gib": 64.0,
        "cuda_graphs": "step",  # on a CPU the static-buffer step without capture: bit-identical
    },
    "phases.phase1": {"description": "edited mid-phase", "eval_grid": False},
}  # fmt: skip
"""Per key that changes no weight: the value it is changed to mid-phase (``S3``: the test's moto bucket)."""
JOB_KEYS_TESTED_ELSEWHERE = {"nproc_per_node", "nnodes", "node_rank", "parallel"}
"""World-size keys: a run resumes with its global batch kept, weights within the DDP tolerance
(tests/stages/test_resilience.py, tests/stages/test_multinode_job.py); ``parallel``: replicated → sharded →
replicated under torchrun (tests/stages/test_train_fsdp.py)."""


def _train(params_file: Path, hooks=()) -> dict:
    return train.run(load_params(params_file), "phase1", hooks=list(hooks))


def _same(a: Path, b: Path) -> bool:
    return all(torch.equal(x, y) for sub in ("unet", "unet_ema") for x, y in
               zip(weights(a, "phase1", sub).values(), weights(b, "phase1", sub).values(), strict=True))  # fmt: skip


def _files(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}  # fmt: skip


@pytest.fixture(scope="module")
def built(tmp_path_factory, straight_phase1):
    """The tiny workspace before training, the phase trained straight through in it (the shared reference), and a
    copy crashed after step 3 (newest checkpoint: step 2)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("SDFORGE_PROGRESS", "0")
    base = tmp_path_factory.mktemp("base")
    untrained_clone(straight_phase1, base)
    crashed = tmp_path_factory.mktemp("crashed")
    with pytest.raises(RuntimeError, match="crashed after step 3"):
        _train(clone_workspace(base, crashed), [CrashAfter(3)])
    yield base, straight_phase1, crashed
    mp.undo()


def test_every_key_that_changes_no_weight_has_a_resume_case():
    none = {k for k, e in keys_by_effect(Train).items() if e is Effect.NONE}
    job = {k for k, e in keys_by_effect(Train).items() if e is Effect.JOB}
    assert set(CHANGES["train"]) == none | (job - JOB_KEYS_TESTED_ELSEWHERE)
    assert set(CHANGES["phases.phase1"]) == {k for k, e in keys_by_effect(Phase).items() if e is not Effect.WEIGHTS}


@pytest.mark.parametrize(("section", "key"), [(s, k) for s, keys in CHANGES.items() for k in keys])
def test_a_key_that_changes_no_weight_resumes_bit_identically(built, tmp_path, moto_s3, monkeypatch, section, key):
    _, straight, crashed = built
    params = clone_workspace(crashed, tmp_path)
    value = CHANGES[section][key]
    edit_params(params, section, **{key: moto_s3.url("ckpts") if value == "S3" else value})
    if key == "validation_every":
        edit_params(params, "eval", steps=2)  # sampling cost only; eval is no training input
    monkeypatch.setenv("SDFORGE_PROGRESS", "0")
    metrics = _train(params)
    assert metrics["resumed_at_step"] == 2 and metrics["steps"] == 6, f"{section}.{key}: not resumed"
    assert metrics["run_dir.moved_aside"] == "" and not stale_runs(tmp_path / "runs")
    assert _same(straight, tmp_path), f"{section}.{key}: weights differ from the uninterrupted run"


def test_a_run_dir_recorded_with_a_reclassified_key_is_the_same_run(built, tmp_path, monkeypatch):
    """A run dir an older sdforge recorded with ``train.gradient_checkpointing: true`` (then a weights key, now
    ``activation_checkpointing: full``, the job's shape): kept, restamped and resumed, not moved aside."""
    _, straight, crashed = built
    params = clone_workspace(crashed, tmp_path)
    edit_params(params, "train", gradient_checkpointing=True)
    run_dir = tmp_path / "runs/phase1"
    record = json.loads((run_dir / "inputs.json").read_text())
    record["params"]["train.gradient_checkpointing"] = True
    older = hashlib.sha256(json.dumps({"params": record["params"], "files": record["files"]}, sort_keys=True,
                                      default=str).encode()).hexdigest()[:16]  # fmt: skip
    (run_dir / "inputs.json").write_text(json.dumps({**record, "fingerprint": older}))
    (run_dir / "fingerprint.txt").write_text(older + "\n")
    monkeypatch.setenv("SDFORGE_PROGRESS", "0")
    metrics = _train(params)
    assert (metrics["resumed_at_step"], metrics["run_dir.moved_aside"]) == (2, "") and not stale_runs(tmp_path / "runs")
    assert (run_dir / "fingerprint.txt").read_text().strip() == record["fingerprint"] != older
    assert metrics["memory.checkpointed_units"] > 0 and _same(straight, tmp_path)


def test_a_weight_key_moves_the_run_aside_and_deletes_nothing_local_or_remote(built, tmp_path, moto_s3, monkeypatch):
    base, _, _ = built
    monkeypatch.setenv("SDFORGE_PROGRESS", "0")
    monkeypatch.setenv("SDFORGE_CHECKPOINT_UPLOAD", "sync")
    params = clone_workspace(base, tmp_path)
    edit_params(params, "train", checkpoint_s3=moto_s3.url("ckpts"))
    with pytest.raises(RuntimeError):
        _train(params, [CrashAfter(5)])
    before_local = _files(tmp_path / "runs/phase1")
    before_remote = {o["Key"]: o["ETag"] for o in moto_s3.client.list_objects_v2(Bucket=moto_s3.bucket)["Contents"]}
    old_fingerprint = (tmp_path / "runs/phase1/fingerprint.txt").read_text().strip()
    edit_params(params, "phases.phase1", lr=2e-3)
    metrics = _train(params)
    assert metrics["resumed_at_step"] == 0 and metrics["steps"] == 6
    [stale] = stale_runs(tmp_path / "runs")
    assert stale.path == tmp_path / f"runs/phase1.stale-{old_fingerprint}" and stale.phase == "phase1"
    assert metrics["run_dir.moved_aside"] == str(stale.path)
    assert (metrics["run_dir.stale_runs"], metrics["run_dir.stale_bytes"]) == (1, stale.bytes)
    kept = _files(stale.path)
    assert {k: v for k, v in kept.items() if k != STALE_NOTE} == before_local  # every file, byte for byte
    assert json.loads((stale.path / STALE_NOTE).read_text())["differs"] == ["phases.phase1.lr"]
    after_remote = {o["Key"]: o["ETag"] for o in moto_s3.client.list_objects_v2(Bucket=moto_s3.bucket)["Contents"]}
    assert before_remote.items() <= after_remote.items()  # nothing overwritten or deleted on S3
    new_fingerprint = (tmp_path / "runs/phase1/fingerprint.txt").read_text().strip()
    assert any(k.startswith(f"ckpts/phase1/{new_fingerprint}/") for k in after_remote)


def test_sdforge_runs_lists_and_removes_stale_runs(tmp_path, capsys):
    from tools.cli import main

    runs = tmp_path / "runs"
    (runs / "phase1").mkdir(parents=True)
    (runs / "phase1.stale-0123456789abcdef").mkdir()
    (runs / "phase1.stale-0123456789abcdef/state.pt").write_bytes(b"x" * 1000)
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump(tiny_params(tmp_path)))  # paths.runs = tmp_path/runs
    with pytest.raises(SystemExit, match="0"):
        main(["runs", "list", "--params", str(params)])
    assert "phase1.stale-0123456789abcdef\t0.0 MB" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="1"):  # without --yes nothing goes
        main(["runs", "clean", "--params", str(params), "--phase", "phase1"])
    assert (runs / "phase1.stale-0123456789abcdef").is_dir()
    with pytest.raises(SystemExit, match="0"):
        main(["runs", "clean", "--params", str(params), "--phase", "phase1", "--yes"])
    assert not (runs / "phase1.stale-0123456789abcdef").exists() and (runs / "phase1").is_dir()

