"""prepare_models' scorers: the FID Inception copied (hash checked) or, for the preflight, a stand-in of its
interface; the scoring CLIP saved from a local folder, a clear error for one that is not there."""

from __future__ import annotations

import hashlib

import pytest
import torch

from sdforge.config import ConfigError, Models
from sdforge.eval.metrics import ClipScorer
from sdforge.eval.weights import copy_inception, prepare_eval_weights, save_clip
from tests.fixtures.eval_workspace import tiny_clip_parts, write_channel_means


def test_a_local_inception_is_copied_hashed_and_checked(tmp_path):
    src = write_channel_means(tmp_path / "src" / "inception.pt")
    digest = hashlib.sha256(src.read_bytes()).hexdigest()
    out = tmp_path / "models"
    out.mkdir()
    got = prepare_eval_weights(Models(fid_inception=str(src), fid_inception_sha256=digest), out)
    assert got == {"fid_inception_weights": "pretrained", "fid_inception_sha256": digest, "fid_features": 3}
    assert (out / "fid_inception.pt").read_bytes() == src.read_bytes()
    with pytest.raises(ConfigError, match="fid_inception_sha256"):
        copy_inception(Models(fid_inception=str(src), fid_inception_sha256="0" * 64), tmp_path / "x.pt")
    with pytest.raises(ConfigError, match="models.fid_inception: .* is not a file"):
        copy_inception(Models(fid_inception=str(tmp_path / "missing.pt")), tmp_path / "y.pt")
    (tmp_path / "junk.pt").write_bytes(b"not torchscript")
    with pytest.raises(ConfigError, match="not a TorchScript model"):
        copy_inception(Models(fid_inception=str(tmp_path / "junk.pt")), tmp_path / "z.pt")


def test_the_preflight_gets_a_seeded_stand_in_with_the_inceptions_interface(tmp_path):
    models = Models(fid_inception="https://example.invalid/inception-2015-12-05.pt", missing_weights="random")
    a, b = copy_inception(models, tmp_path / "a.pt"), copy_inception(models, tmp_path / "b.pt")
    assert a["fid_inception_weights"] == b["fid_inception_weights"] == "random" and a["fid_features"] == 2048
    net_a, net_b = torch.jit.load(str(tmp_path / "a.pt")), torch.jit.load(str(tmp_path / "b.pt"))
    x = torch.rand(2, 3, 40, 30) * 255
    assert torch.equal(net_a(x, return_features=True), net_b(x, return_features=True))  # seeded: the same network


def test_a_local_clip_is_saved_and_scores(tmp_path):
    model, processor = tiny_clip_parts(tmp_path / "src")
    model.save_pretrained(tmp_path / "src" / "clip")
    processor.save_pretrained(tmp_path / "src" / "clip")
    assert save_clip(Models(eval_clip=str(tmp_path / "src" / "clip")), tmp_path / "eval_clip") == "pretrained"
    saved = ClipScorer(tmp_path / "eval_clip")
    assert all(torch.equal(a, b) for a, b in zip(saved.model.state_dict().values(), model.state_dict().values(),
                                                 strict=True))  # fmt: skip


def test_a_clip_that_is_not_here_is_an_error_naming_the_key(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError, match="models.eval_clip"):
        save_clip(Models(eval_clip=str(tmp_path / "nowhere")), tmp_path / "out")
    with pytest.raises(ConfigError, match="no vision tower stored for 'someone/clip'"):
        save_clip(Models(eval_clip="someone/clip", missing_weights="random"), tmp_path / "out")
