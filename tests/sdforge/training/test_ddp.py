"""train stage under torchrun (2 CPU processes, gloo): it runs through the stage CLI, and DDP with batch B per
rank trains like one process with batch 2B.

Why the two runs can agree: each step trains one global batch of the epoch's plan and rank r takes its part
``[r·B, (r+1)·B)`` of it, so the two ranks together train the batch of one process with twice the batch; every
sample's noise, timestep and CFG drop come from its own stream, seeded by its position in the global batch
(:func:`sdforge.training.distributed.step_seeds`); the loss is a per-sample mean (Min-SNR weights are per
sample) and DDP averages the ranks' gradients, so the gradient is the mean over the 2B samples. What is left
is float32 summation order (in the UNet's batched ops and the all-reduce), amplified a little by Adam.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from sdforge.latents.bucket_batches import BatchSplit, plan_epoch
from sdforge.training.distributed import part_generators, step_seeds
from tests.fixtures.training import DDP_MAX_ABS_DIFF, build_workspace, train, untrained_clone, weights


def _set(params_file: Path, nproc: int, batch_size: int) -> None:
    data = yaml.safe_load(params_file.read_text())
    data["train"]["nproc_per_node"] = nproc
    data["phases"]["phase1"]["batch_size"] = batch_size
    params_file.write_text(yaml.safe_dump(data))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, straight_phase1):
    """phase1 trained through the stage CLI with ``nproc_per_node: 2`` (torchrun, gloo), batch 4 per rank."""
    root = tmp_path_factory.mktemp("ddp2")
    params = untrained_clone(straight_phase1, root)
    _set(params, nproc=2, batch_size=4)
    return root, train(params, "phase1")


@pytest.mark.parametrize(("world", "accum"), [(2, 1), (4, 1), (2, 3)])
def test_a_sample_gets_the_same_rows_and_streams_on_any_world_size(world, accum):
    """A step's global batch (plan order) and its seeds are the same for every split; rank r's micro-step k takes
    the positions (and seeds) ``part(k, r)`` of both — what one process with the whole batch has there."""
    global_batch, seed = 24, 7
    plan = plan_epoch(np.zeros(100, np.int32), 0, seed, global_batch)
    one = BatchSplit(global_batch, 1, 1)
    whole_seeds = step_seeds(torch.Generator().manual_seed(seed), global_batch)
    split = BatchSplit(global_batch // (world * accum), accum, world)
    shared_after = []
    for rank in range(world):
        shared = torch.Generator().manual_seed(seed)
        seeds = step_seeds(shared, split.global_batch)
        mine = plan.micro_batches(rank, split)[:accum]  # step 0
        for k in range(accum):
            part = split.part(k, rank)
            assert (mine[k] == plan.micro_batches(0, one)[0][part]).all()
            got = [torch.randn(5, generator=g) for g in part_generators(seeds[part])]
            want = [torch.randn(5, generator=g) for g in part_generators(whole_seeds[part])]
            assert all(torch.equal(x, y) for x, y in zip(got, want, strict=True))
        shared_after.append(shared.get_state())
    assert all(torch.equal(s, shared_after[0]) for s in shared_after)  # the shared stream stays in step


def test_two_process_run_through_the_stage_cli(two_ranks):
    """The real launch path: ~25 s idle (torchrun + 2 ranks on 2 cores), ~85 s on a busy machine."""
    two, done = two_ranks
    assert done.returncode == 0, done.stderr[-4000:]
    launched = "torch.distributed.run --nproc_per_node 2 --nnodes 1 --node_rank 0 --shutdown_timeout 35 --standalone"
    assert launched in done.stderr
    metrics = json.loads((two / "metrics/train/phase1.json").read_text())
    assert metrics["world_size"] == 2
    assert metrics["steps"] == 6  # 48 samples / (2 ranks × batch 4 × accum 2) = 3 steps × 2 epochs
    assert np.isfinite(metrics["final_loss"])
    from sdforge.config import load_params
    from sdforge.training.unet_init import load_init_unet

    spec = load_params(two / "params.yaml").models.unet.model_dump()
    init = weights(two, "scratch", "unet")
    for sub in ("unet", "unet_ema"):
        unet = load_init_unet(two / "checkpoints/phase1", "live" if sub == "unet" else "ema", spec)
        trained = unet.state_dict()
        assert all(torch.isfinite(v).all() for v in trained.values())
        assert any(not torch.equal(trained[k], init[k]) for k in init), f"{sub} did not move from its init"


def test_ddp_matches_one_process_with_double_batch(two_ranks, straight_phase1):
    """The acceptance test: the 2-rank run against the shared 1-process run (batch 8, the suite's reference)."""
    (two, done_two), one = two_ranks, straight_phase1
    assert done_two.returncode == 0, done_two.stderr[-4000:]
    for sub in ("unet", "unet_ema"):
        a, b = weights(two, "phase1", sub), weights(one, "phase1", sub)
        assert a.keys() == b.keys()
        diff = max(float((a[k].double() - b[k].double()).abs().max()) for k in a)
        moved = max(float((a[k].double() - weights(one, "scratch", "unet")[k].double()).abs().max()) for k in a)
        print(f"{sub}: max |2 ranks x B - 1 process x 2B| = {diff:.3g} (largest change from init {moved:.3g})")
        assert diff <= DDP_MAX_ABS_DIFF, f"{sub}: DDP differs from the 1-process run by {diff:.3g} > {DDP_MAX_ABS_DIFF}"
    m_two = json.loads((two / "metrics/train/phase1.json").read_text())
    m_one = json.loads((one / "metrics/train/phase1.json").read_text())
    assert m_two["steps"] == m_one["steps"] == 6
    assert m_two["final_loss"] == pytest.approx(m_one["final_loss"], rel=1e-4)


DISTILL = {"adapter": {"rank": 2, "targets": ["self_attention", "cross_attention"], "merge": False},
           "distill": {"num_ddim_timesteps": 5, "w_min": 2.0, "w_max": 4.0}, "cfg_dropout": 0.0,
           "min_snr_gamma": None, "timestep_sampling": "uniform"}  # fmt: skip
"""Phase 2 as an LCM-LoRA of phase 1 (docs/ADAPTERS.md "Distillation")."""


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["adapter", "distill"])
def test_an_adapter_phase_under_ddp_matches_one_process_with_double_batch(tmp_path_factory, kind):
    """Phase 2 as a LoRA on a trained phase 1 (the same weights in both workspaces) — with a learned word, or
    distilling phase 1 (teacher, student and target: three calls of the adapted UNet on each rank): the adapter,
    the only weights that train, agrees between 2 ranks × batch 4 and one process × batch 8 to the full-phase
    tolerance (~90 s each)."""
    import shutil

    from safetensors.torch import load_file

    roots = {nproc: tmp_path_factory.mktemp(f"{kind}-ddp{nproc}") for nproc in (1, 2)}
    params = {nproc: build_workspace(root) for nproc, root in roots.items()}
    assert train(params[1], "phase1").returncode == 0
    shutil.copytree(roots[1] / "checkpoints/phase1", roots[2] / "checkpoints/phase1")
    for nproc, batch in ((1, 8), (2, 4)):
        data = yaml.safe_load(params[nproc].read_text())
        data["train"]["nproc_per_node"] = nproc
        adapter = {"rank": 2, "targets": ["self_attention", "cross_attention"], "words": ["a"]}  # text encoder row
        phase = {"adapter": adapter} if kind == "adapter" else DISTILL
        data["phases"]["phase2"].update(batch_size=batch, lr=5e-3, **phase)
        params[nproc].write_text(yaml.safe_dump(data))
        done = train(params[nproc], "phase2")
        assert done.returncode == 0, done.stderr[-4000:]
    for sub in ("adapter", "adapter_ema"):
        a, b = (load_file(roots[n] / "checkpoints/phase2" / sub / "pytorch_lora_weights.safetensors") for n in (2, 1))
        assert a.keys() == b.keys() and a
        diff = max(float((a[k].double() - b[k].double()).abs().max()) for k in a)
        moved = max(float(b[k].double().abs().max()) for k in b if ".lora_B." in k)  # lora_B starts at zero
        print(f"{kind} {sub}: max |2 ranks x B - 1 process x 2B| = {diff:.3g} (largest lora_B entry {moved:.3g})")
        assert moved > 1e-4 and diff <= DDP_MAX_ABS_DIFF, f"{sub}: DDP differs from the 1-process run by {diff:.3g}"
        if kind == "distill":
            continue
        a, b = (load_file(roots[n] / "checkpoints/phase2" / sub / "learned_embeds.safetensors") for n in (2, 1))
        base = load_file(roots[1] / "models/text_encoder/model.safetensors")["embeddings.token_embedding.weight"]
        word_diff, word_moved = float((a["a"] - b["a"]).abs().max()), float((b["a"] - base[320]).abs().max())
        print(f"{sub}: learned word: max |2 ranks - 1 process| = {word_diff:.3g} (moved {word_moved:.3g})")
        assert word_moved > 1e-4 and word_diff <= DDP_MAX_ABS_DIFF, f"{sub}: the learned word differs under DDP"
