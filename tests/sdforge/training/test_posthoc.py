"""``sdforge.training.posthoc.write_candidate_checkpoint`` replaces its ``out_dir`` whole: never the checkpoint or
run dir it reads (issue 55's audit of deleting call sites)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from sdforge.io import InputError
from sdforge.training.checkpoints import POSTHOC_DIR
from sdforge.training.posthoc import FIXED, FIXED_EMA, write_candidate_checkpoint


def _tree(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): b"<dir>" if p.is_dir() else p.read_bytes() for p in folder.rglob("*")}


@pytest.mark.parametrize("where", ["the checkpoint", "inside the checkpoint", "the run dir", "around both"])
def test_a_candidate_copy_never_replaces_what_it_reads(tmp_path, where):
    checkpoint, run = tmp_path / "checkpoints/phase1", tmp_path / "runs/phase1"
    (checkpoint / "unet_ema").mkdir(parents=True)
    (checkpoint / "unet_ema/diffusion_pytorch_model.safetensors").write_bytes(b"the phase's weights")
    (run / POSTHOC_DIR).mkdir(parents=True)
    save_file({"0": torch.zeros(2)}, run / POSTHOC_DIR / FIXED_EMA)  # a readable candidate: the copy would go ahead
    out = {"the checkpoint": checkpoint, "inside the checkpoint": checkpoint / "candidate", "the run dir": run,
           "around both": tmp_path}[where]  # fmt: skip
    before = _tree(tmp_path)
    with pytest.raises(InputError, match=r"out_dir .*: overlaps the (checkpoint|run dir) "):
        write_candidate_checkpoint(checkpoint, run, FIXED, out)
    assert _tree(tmp_path) == before
