"""train stage, adapter phases: only the adapter (and its learned words) trains, a SIGKILLed run resumes to
bitwise-equal adapter weights, the outputs (merged or base UNet, diffusers LoRA files, learned words), DoRA."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import CLIPTextModel, CLIPTokenizer

from sdforge.config import load_params
from sdforge.eval.sampling import load_pipeline
from sdforge.io import InputError
from sdforge.training.conditioning import word_token_id
from tests.fixtures.training import check_resumed, clone_workspace, straight_and_killed, train, weights

LORA = {"type": "lora", "rank": 2, "targets": ["self_attention", "cross_attention"], "words": ["a"]}
WORD_ID = 320  # "a" in the demo tokenizer; the tiny store's random token ids hold it twice
DORA = {"type": "dora", "rank": 2, "targets": ["cross_attention"], "merge": False}
ADAPTED = (".attn1.to_", ".attn2.to_")
# phase2 as in test_train: 3 optimizer steps per epoch, checkpoints at steps 2, 3 (epoch end), 4, 6
RESUME_FROM = {3: 2, 4: 4, 5: 4}
KILL_SEED = int(os.environ.get("SDFORGE_KILL_SEED", random.SystemRandom().randrange(2**31)))
KILL_AT = random.Random(KILL_SEED).choice(sorted(RESUME_FROM))
LORA_FILE = "pytorch_lora_weights.safetensors"
WORDS_FILE = "learned_embeds.safetensors"


def adapter_workspace(straight_phase1: Path, root: Path, adapter: dict) -> Path:
    """The tiny workspace with phase 1 trained (full: a copy of the shared one) and phase 2 an adapter phase on it
    (phase 2's keys are no input of phase 1: its finished run stays valid)."""
    params_file = clone_workspace(straight_phase1, root)
    data = yaml.safe_load(params_file.read_text())
    data["phases"]["phase2"].update(adapter=adapter, lr=5e-3)
    params_file.write_text(yaml.safe_dump(data))
    return params_file


@pytest.fixture(scope="module")
def runs(tmp_path_factory, straight_phase1):
    """Phase 2 with LoRA and a learned word, straight through, and SIGKILLed then resumed. The killed run trains with
    ``train.cuda_graphs: step`` (on a CPU the static-buffer step, docs/SPEED.md): the adapter and the word's row
    through the static path too, bit-identical to the eager straight run."""
    straight = adapter_workspace(straight_phase1, tmp_path_factory.mktemp("straight"), LORA)
    killed = adapter_workspace(straight_phase1, tmp_path_factory.mktemp("killed"), LORA)
    data = yaml.safe_load(killed.read_text())
    data["train"]["cuda_graphs"] = "step"
    killed.write_text(yaml.safe_dump(data))
    return straight_and_killed(straight, killed, "phase2", KILL_AT)


def test_sigkill_then_resume_gives_bitwise_equal_adapter_weights(runs):
    straight, killed, died, resumed = runs
    why = check_resumed(died, resumed, KILL_AT, RESUME_FROM[KILL_AT], KILL_SEED)
    for sub in ("adapter", "adapter_ema"):
        for name in (LORA_FILE, WORDS_FILE):
            a, b = (load_file(root / "checkpoints/phase2" / sub / name) for root in (straight, killed))
            assert a.keys() == b.keys() and a, sub
            assert all(torch.equal(a[k], b[k]) for k in a), f"{sub}/{name} differs after resume ({why})"
    for sub in ("unet", "unet_ema"):
        a, b = weights(straight, "phase2", sub), weights(killed, "phase2", sub)
        assert all(torch.equal(a[k], b[k]) for k in a), f"{sub} differs after resume ({why})"


def test_only_the_adapter_trained_and_its_share_is_reported(runs):
    straight = runs[0]
    metrics = json.loads((straight / "metrics/train/phase2.json").read_text())
    assert metrics["steps"] == 6 and 0 < metrics["trainable_params"] < 0.05 * metrics["unet_params"]
    assert metrics["trainable_share"] == pytest.approx(metrics["trainable_params"] / metrics["unet_params"], abs=1e-6)
    full = json.loads((straight / "metrics/train/phase1.json").read_text())
    assert full["trainable_params"] == full["unet_params"] == metrics["unet_params"]
    # checkpoints hold the adapter's tensors only, not a UNet
    ckpt = sorted((straight / "runs/phase2").glob("checkpoint-*"))[-1]
    assert not (ckpt / "unet").exists()
    saved = load_file(ckpt / "adapter/adapter_weights.safetensors")
    assert sum(t.numel() for t in saved.values()) == metrics["trainable_params"]
    # merged: the UNet differs from phase 1's EMA exactly in the adapted layers' weights
    base, merged = weights(straight, "phase1", "unet_ema"), weights(straight, "phase2", "unet_ema")
    assert base.keys() == merged.keys()
    changed = {k for k in base if not torch.equal(base[k], merged[k])}
    assert changed and all(any(a in k for a in ADAPTED) and k.endswith(".weight") for k in changed)
    # the LoRA file is in diffusers' format with peft's key names (sdforge/training/adapter_files.py says why), its
    # config (rank, alpha) in the metadata
    lora_path = straight / "checkpoints/phase2/adapter_ema" / LORA_FILE
    assert all(k.startswith("unet.") and (".lora_A." in k or ".lora_B." in k) for k in load_file(lora_path))
    with safe_open(lora_path, "pt") as f:
        config = json.loads(f.metadata()["lora_adapter_metadata"])
    assert (config["unet.r"], config["unet.lora_alpha"], config["unet.use_dora"]) == (2, 2, False)
    assert state_words(straight) == ["a"]
    state = json.loads((straight / "checkpoints/phase2/state.json").read_text())
    # the objective the phase trained (the tiny params inherit the demo's train.objective), recorded for sampling
    want = load_params(straight / "params.yaml").phase_objective("phase2")
    assert state["adapter"]["merge"] is True and state["objective"] == want == "flow_matching"


def state_words(root: Path) -> list[str]:
    return json.loads((root / "checkpoints/phase2/state.json").read_text())["adapter"]["words"]


def test_the_learned_word_trained_and_every_sampler_uses_it(runs):
    straight = runs[0]
    encoder = CLIPTextModel.from_pretrained(straight / "models/text_encoder")
    base_row = encoder.get_input_embeddings().weight[WORD_ID].detach()
    live, ema = (load_file(straight / "checkpoints/phase2" / sub / WORDS_FILE) for sub in ("adapter", "adapter_ema"))
    assert list(live) == list(ema) == ["a"] and live["a"].shape == base_row.shape
    assert float((live["a"] - base_row).abs().max()) > 1e-4  # the row moved
    assert not torch.equal(live["a"], ema["a"])  # the EMA of the row is what unet_ema pairs with
    for use_ema, want in ((True, ema), (False, live)):  # eval grid, generate and export all load through here
        pipe = load_pipeline(straight / "models", straight / "checkpoints/phase2", use_ema=use_ema, device="cpu")
        assert torch.equal(pipe.text_encoder.get_input_embeddings().weight[WORD_ID], want["a"])
    plain = load_pipeline(straight / "models", straight / "checkpoints/phase1", device="cpu")
    assert torch.equal(plain.text_encoder.get_input_embeddings().weight[WORD_ID], base_row)


def test_a_word_that_is_not_one_token_is_refused_by_name(straight_phase1):
    tokenizer = CLIPTokenizer.from_pretrained(straight_phase1 / "models/tokenizer")
    assert word_token_id(tokenizer, "a", "phases.phase2.adapter.words") == WORD_ID
    with pytest.raises(InputError, match=r"phases\.phase2\.adapter\.words: 'zebracorn' is not one token"):
        word_token_id(tokenizer, "zebracorn", "phases.phase2.adapter.words")


def test_dora_unmerged_keeps_the_base_and_eval_applies_the_adapter(tmp_path, straight_phase1):
    params_file = adapter_workspace(straight_phase1, tmp_path, DORA)
    done = train(params_file, "phase2")
    assert done.returncode == 0, done.stderr[-3000:]
    root = params_file.parent
    for sub in ("unet", "unet_ema"):  # merge: false: the phase's UNet folders are phase 1's EMA, unchanged
        base, kept = weights(root, "phase1", "unet_ema"), weights(root, "phase2", sub)
        assert all(torch.equal(base[k], kept[k]) for k in base)
    lora = load_file(root / "checkpoints/phase2/adapter_ema" / LORA_FILE)
    assert any("lora_magnitude_vector" in k for k in lora)
    pipe = load_pipeline(root / "models", root / "checkpoints/phase2", device="cpu")
    assert "default_0" in pipe.unet.peft_config or pipe.unet.peft_config  # the adapter is applied on load
    plain = load_pipeline(root / "models", root / "checkpoints/phase1", device="cpu")
    assert pipe.checkpoint_hash != plain.checkpoint_hash
    x, t = torch.randn(1, 4, 8, 8), torch.tensor([500])
    c = torch.randn(1, 16, pipe.unet.config.cross_attention_dim)
    with torch.no_grad():
        assert not torch.equal(pipe.unet(x, t, encoder_hidden_states=c).sample, plain.unet(x, t, c).sample)
