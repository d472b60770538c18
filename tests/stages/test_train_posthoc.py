"""Post-hoc EMA in training: snapshots at their steps, the rebuilt candidates scored with the fixed EMA, the best
exported as unet_ema/, and a SIGKILL + resume giving the same phase bit for bit."""

import json

import pytest
import torch
from diffusers import UNet2DConditionModel
from safetensors.torch import load_file

from model.denoisers import family
from sdforge.training.checkpoints import PREFIX, STATE
from sdforge.training.posthoc import POSTHOC_DIR, rebuild, snapshot_steps
from tests.fixtures.training import (
    DDP_MAX_ABS_DIFF,
    build_workspace,
    edit_params,
    train,
    untrained_clone,
    weights,
)

SIGMA_RELS, CANDIDATES = [0.05, 0.1], [0.05, 0.15, 0.25]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """phase1 (4 steps) trained with post-hoc EMA, uninterrupted; its params file."""
    params = build_workspace(tmp_path_factory.mktemp("posthoc"), held_out=16)
    edit_params(params, "train", posthoc_sigma_rels=SIGMA_RELS, posthoc_snapshots=4, posthoc_candidates=CANDIDATES)
    done = train(params, "phase1")
    assert done.returncode == 0, done.stderr[-3000:]
    return params


def _metrics(params):
    return json.loads((params.parent / "metrics" / "train" / "phase1.json").read_text())


def test_snapshot_steps_are_even_and_end_at_the_last_step():
    assert snapshot_steps(4, 4) == [1, 2, 3, 4] and snapshot_steps(600, 8) == list(range(75, 601, 75))
    assert snapshot_steps(3, 8) == [1, 2, 3]


def test_the_best_candidate_is_exported_as_unet_ema(straight):
    root, m = straight.parent, _metrics(straight)
    scores = {name: m[f"posthoc_ema.val_loss.{name}"] for name in ("fixed", "0.05", "0.15", "0.25")}
    best = min(scores, key=scores.get)
    assert m["posthoc_ema.sigma_rel"] == (0.0 if best == "fixed" else float(best))
    assert m["final_val_loss"] == scores[best] and m["posthoc_ema.snapshots"] == 4
    assert len(set(scores.values())) == 4  # four different weight sets
    run = root / "runs" / "phase1"
    paths = sorted((run / POSTHOC_DIR).glob("step-*.safetensors"))
    assert [p.name for p in paths] == [f"step-{s:08d}.safetensors" for s in (1, 2, 3, 4)]
    names = _names(root)
    exported = weights(root, "phase1", "unet_ema")
    if best == "fixed":
        expected = _fixed_ema(run)
    else:
        expected = rebuild(paths, SIGMA_RELS, _gammas(), 4, float(best), len(names))
    assert all(torch.equal(exported[n], t) for n, t in zip(names, expected, strict=True))
    other = rebuild(paths, SIGMA_RELS, _gammas(), 4, 0.25 if best != "0.25" else 0.05, len(names))
    assert not all(torch.equal(exported[n], t) for n, t in zip(names, other, strict=True))


def _names(root):
    unet = UNet2DConditionModel.from_pretrained(root / "checkpoints/phase1/unet_ema")
    return [n for n, _ in unet.named_parameters()]


def _fixed_ema(run):
    """The fixed-decay EMA of the run's newest checkpoint."""
    newest = sorted(run.glob(f"{PREFIX}*"))[-1]
    return torch.load(newest / STATE, weights_only=True)["ema"]["shadow_params"]


def _gammas():
    from model.posthoc_ema import gamma_of

    return [gamma_of(s) for s in SIGMA_RELS]


def test_a_sigkill_then_resume_exports_the_same_weights_and_choice(straight, tmp_path):
    params = untrained_clone(straight.parent, tmp_path)
    killed = train(params, "phase1", kill_at=3)  # after step 3's snapshot; resumes from step 2's checkpoint
    assert killed.returncode != 0 and (tmp_path / "runs/phase1" / POSTHOC_DIR / "step-00000003.safetensors").is_file()
    done = train(params, "phase1")
    assert done.returncode == 0, done.stderr[-3000:]
    assert _metrics(params)["resumed_at_step"] == 2
    ours, theirs = _metrics(straight), _metrics(params)
    assert {k: v for k, v in ours.items() if k.startswith("posthoc_ema.val_loss")} == {
        k: v for k, v in theirs.items() if k.startswith("posthoc_ema.val_loss")}
    for sub in ("unet", "unet_ema"):
        a, b = weights(straight.parent, "phase1", sub), weights(tmp_path, "phase1", sub)
        assert all(a[k].equal(b[k]) for k in a), sub


def test_a_lost_snapshot_exports_the_fixed_ema_and_says_so(straight, tmp_path):
    """A run resumed elsewhere (checkpoint_s3) lacks the earlier snapshots: the fixed EMA, a counted warning."""
    from tests.fixtures.training import clone_workspace

    params = clone_workspace(straight.parent, tmp_path)
    (tmp_path / "runs/phase1" / POSTHOC_DIR / "step-00000001.safetensors").unlink()
    done = train(params, "phase1")  # the finished run again: restored at its last step, only the end runs
    assert done.returncode == 0, done.stderr[-3000:]
    m = _metrics(params)
    assert m["posthoc_ema.missing_snapshots"] == 1 and m["posthoc_ema.sigma_rel"] == 0.0
    assert [k for k in m if k.startswith("posthoc_ema.val_loss")] == ["posthoc_ema.val_loss.fixed"]
    exported = weights(tmp_path, "phase1", "unet_ema")
    fixed = _fixed_ema(tmp_path / "runs/phase1")
    assert all(torch.equal(exported[n], t) for n, t in zip(_names(tmp_path), fixed, strict=True))
    assert "snapshot(s) missing" in done.stderr


def test_every_candidate_can_be_read_back_and_scored_offline(straight, tmp_path):
    """After the phase: the fixed EMA (kept when a rebuild won) and every σ_rel are readable; a candidate written into
    a checkpoint copy holds exactly its tensors, and the offline validation loss of each equals the in-run score."""
    from sdforge.config import load_params
    from sdforge.training.conditioning import Conditioning
    from sdforge.training.posthoc import FIXED, candidate_weights, write_candidate_checkpoint
    from sdforge.training.val_loss import HeldOutLoss

    root, m = straight.parent, _metrics(straight)
    run, checkpoint = root / "runs/phase1", root / "checkpoints/phase1"
    chosen = FIXED if m["posthoc_ema.sigma_rel"] == 0 else f"{m['posthoc_ema.sigma_rel']:g}"
    names = _names(root)
    exported = weights(root, "phase1", "unet_ema")
    if chosen != FIXED:
        assert all(torch.equal(a, b) for a, b in zip(candidate_weights(run, FIXED), _fixed_ema(run), strict=True))
        assert all(torch.equal(exported[n], t) for n, t in zip(names, candidate_weights(run, chosen), strict=True))
    paths = sorted((run / POSTHOC_DIR).glob("step-*.safetensors"))
    early = rebuild(paths[:2], SIGMA_RELS, _gammas(), 2, 0.15, len(names))  # as it was at step 2
    assert all(torch.equal(a, b) for a, b in zip(candidate_weights(run, "0.15", step=2), early, strict=True))
    params = load_params(straight)
    held_out = HeldOutLoss.for_phase(params, "phase1")
    conditioning = Conditioning(root / "models", torch.device("cpu"), params.train.text_encoder_dtype,
                                family(params.models.denoiser.family))
    before = {n: t.clone() for n, t in exported.items()}
    for name in [c for c in ("fixed", "0.05", "0.15", "0.25") if c != chosen]:
        out = write_candidate_checkpoint(checkpoint, run, name, tmp_path / name)
        unet = UNet2DConditionModel.from_pretrained(out / "unet_ema")
        assert all(torch.equal(p, t) for p, t in zip(unet.parameters(), candidate_weights(run, name), strict=True))
        val = held_out.measure_unet(unet, conditioning, params.phase_objective("phase1"))["val_loss"]
        assert val == pytest.approx(m[f"posthoc_ema.val_loss.{name}"], abs=2e-6)
    assert all(torch.equal(before[n], t) for n, t in weights(root, "phase1", "unet_ema").items())  # untouched


@pytest.mark.ranks  # several training processes at once: `make test-ranks` (CI runs it after `make test`)
def test_two_sharded_ranks_killed_and_resumed_snapshot_and_choose_like_one_process(straight, tmp_path):
    """``train.parallel: fsdp`` on 2 ranks (batch 4 each: the same global batch), SIGKILLed after step 3's snapshot
    and resumed from step 2's sharded checkpoint (the tracked EMAs among its shards): every snapshot holds the whole
    tensors, within the DDP tolerance of the one-process run's, the same candidate wins and ``unet_ema/`` agrees."""
    params = untrained_clone(straight.parent, tmp_path)
    edit_params(params, "train", parallel="fsdp", nproc_per_node=2)
    edit_params(params, "phases.phase1", batch_size=4)
    assert train(params, "phase1", kill_at=3).returncode != 0
    done = train(params, "phase1")
    assert done.returncode == 0, done.stderr[-3000:]
    ours, theirs = _metrics(params), _metrics(straight)
    assert (ours["parallel"], ours["world_size"], ours["resumed_at_step"]) == ("fsdp", 2, 2)
    assert ours["posthoc_ema.sigma_rel"] == theirs["posthoc_ema.sigma_rel"]
    for name in ("fixed", "0.05", "0.15", "0.25"):
        key = f"posthoc_ema.val_loss.{name}"
        assert ours[key] == pytest.approx(theirs[key], rel=1e-4), key
    for step in (1, 2, 3, 4):
        snapshot = f"runs/phase1/{POSTHOC_DIR}/step-{step:08d}.safetensors"
        a, b = load_file(tmp_path / snapshot), load_file(straight.parent / snapshot)
        assert a.keys() == b.keys() and all(a[k].shape == b[k].shape for k in a)
        assert max(float((a[k] - b[k]).abs().max()) for k in a) <= DDP_MAX_ABS_DIFF, snapshot
    a, b = weights(tmp_path, "phase1", "unet_ema"), weights(straight.parent, "phase1", "unet_ema")
    assert max(float((a[k] - b[k]).abs().max()) for k in a) <= DDP_MAX_ABS_DIFF


def test_a_phase_that_opts_out_keeps_the_fixed_ema_only(straight, tmp_path):
    params = untrained_clone(straight.parent, tmp_path)
    edit_params(params, "phases.phase1", posthoc_ema=False)
    done = train(params, "phase1")
    assert done.returncode == 0, done.stderr[-3000:]
    m = _metrics(params)
    assert not [k for k in m if k.startswith("posthoc_ema")] and not (tmp_path / "runs/phase1" / POSTHOC_DIR).exists()
    fixed = _fixed_ema(straight.parent / "runs/phase1")  # the post-hoc run's fixed EMA: training is the same
    exported = weights(tmp_path, "phase1", "unet_ema")
    assert all(torch.equal(exported[n], t) for n, t in zip(_names(tmp_path), fixed, strict=True))


def test_a_pod_resumed_from_s3_fetches_the_snapshots_and_exports_the_same_weights(straight, tmp_path, moto_s3,
                                                                                  monkeypatch):  # fmt: skip
    import shutil

    params = untrained_clone(straight.parent, tmp_path)
    edit_params(params, "train", checkpoint_s3=moto_s3.url("ckpts"))
    monkeypatch.setenv("SDFORGE_CHECKPOINT_UPLOAD", "sync")  # uploads finish before the kill
    died = train(params, "phase1", kill_at=3)  # snapshots 1-3 written; checkpoint 2 uploaded with snapshots 1-2
    assert died.returncode == -9, died.stderr[-3000:]
    listing = moto_s3.client.list_objects_v2(Bucket=moto_s3.bucket, Prefix="ckpts/phase1/")
    uploaded = sorted(k["Key"].rsplit("/", 1)[-1] for k in listing["Contents"] if f"/{POSTHOC_DIR}/" in k["Key"])
    assert uploaded == ["step-00000001.safetensors", "step-00000002.safetensors"]
    shutil.rmtree(tmp_path / "runs")  # a fresh pod
    monkeypatch.delenv("SDFORGE_CHECKPOINT_UPLOAD")
    done = train(params, "phase1")
    assert done.returncode == 0, done.stderr[-3000:]
    m, first = _metrics(params), _metrics(straight)
    assert m["resumed_at_step"] == 2 and m["posthoc_ema.missing_snapshots"] == 0
    assert m["posthoc_ema.sigma_rel"] == first["posthoc_ema.sigma_rel"]
    a, b = weights(straight.parent, "phase1", "unet_ema"), weights(tmp_path, "phase1", "unet_ema")
    assert all(torch.equal(a[k], b[k]) for k in a)
