"""Post-hoc EMA in training: snapshots at their steps, the rebuilt candidates scored with the fixed EMA, the best
exported as unet_ema/, and a SIGKILL + resume giving the same phase bit for bit."""

import json

import pytest
import torch
from diffusers import UNet2DConditionModel

from sdforge.training.checkpoints import PREFIX, STATE
from sdforge.training.posthoc import POSTHOC_DIR, rebuild, snapshot_steps
from tests.fixtures.training import build_workspace, edit_params, train, untrained_clone, weights

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
