"""Model wiring: UNet config and zero-init, parameter counts, tiny VAE / text encoder, CLIP vocab, scheduler."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import CLIPTokenizer, CLIPTokenizerFast

from model.builders import (
    BOS_TOKEN,
    EOS_TOKEN,
    build_tiny_text_encoder,
    build_tiny_vae,
    build_unet,
    clip_vocab_and_merges,
    count_parameters,
    noise_scheduler,
    output_projections,
    unet_config,
    vae_downsample_factor,
)
from sdforge.config import NoiseSchedule, UNetSpec

SD1_UNET_PARAMS = 859_520_964

TINY_UNET = UNetSpec(
    sample_size=8,
    block_out_channels=[32, 64],
    layers_per_block=1,
    down_block_types=["CrossAttnDownBlock2D", "DownBlock2D"],
    up_block_types=["UpBlock2D", "CrossAttnUpBlock2D"],
    cross_attention_dim=16,
    attention_head_dim=4,
    norm_num_groups=8,
)

DEMO_WORDS = ["a", "on", "background", "red", "green", "blue", "yellow", "purple",
              "circle", "square", "triangle", "white", "black"]


def test_sd15_unet_on_meta_device_has_exact_parameter_count():
    config = unet_config(UNetSpec().model_dump())
    with torch.device("meta"):
        unet = build_unet(config, seed=0)
    assert count_parameters(unet) == SD1_UNET_PARAMS
    assert next(unet.parameters()).device.type == "meta"
    assert unet.config.block_out_channels == (320, 640, 1280, 1280)
    assert unet.config.cross_attention_dim == 768
    assert unet.config.attention_head_dim == 8


def test_unet_config_rejects_unknown_keys_and_bad_group_count():
    spec = TINY_UNET.model_dump()
    with pytest.raises(ValueError, match=r"unknown: \['attn_heads'\]"):
        unet_config({**spec, "attn_heads": 8})
    with pytest.raises(ValueError, match=r"missing: \['sample_size'\]"):
        unet_config({k: v for k, v in spec.items() if k != "sample_size"})
    with pytest.raises(ValueError, match="divisible by norm_num_groups=24"):
        unet_config({**spec, "norm_num_groups": 24})


def test_output_projections_are_zero_and_everything_else_is_not():
    unet = build_unet(unet_config(TINY_UNET.model_dump()), seed=0)
    layers = output_projections(unet)
    names = sorted(layers)
    # down: 2 blocks x 1 resnet; mid: 2 resnets + 1 transformer; up: 2 blocks x 2 resnets;
    # transformers: 1 in the down cross-attn block, 1 mid, 2 in the up cross-attn block
    assert "conv_out" in names
    assert sum(n.endswith(".conv2") for n in names) == 8
    assert sum(n.endswith(".attn1.to_out.0") for n in names) == 4
    assert sum(n.endswith(".attn2.to_out.0") for n in names) == 4
    assert sum(n.endswith(".ff.net.2") for n in names) == 4
    assert sum(n.endswith(".proj_out") for n in names) == 4
    assert len(names) == 1 + 8 + 4 * 4
    zeroed = {f"{name}.{p}" for name in layers for p in ("weight", "bias")}
    for name, param in unet.named_parameters():
        if name in zeroed:
            assert torch.count_nonzero(param) == 0, name
        elif name.endswith(".bias") and ("norm" in name.split(".")[-2]):
            continue  # GroupNorm / LayerNorm biases start at zero by design
        else:
            assert torch.count_nonzero(param) > 0, name
    # with conv_out zero the untrained UNet predicts exactly zero noise
    x = torch.randn(2, 4, 8, 8)
    out = unet(x, torch.tensor([10, 500]), encoder_hidden_states=torch.randn(2, 5, 16)).sample
    assert out.shape == (2, 4, 8, 8)
    assert torch.count_nonzero(out) == 0


def test_build_unet_is_seeded_and_leaves_global_rng_alone():
    config = unet_config(TINY_UNET.model_dump())
    torch.manual_seed(123)
    expected_next = torch.rand(1)
    torch.manual_seed(123)
    a = build_unet(config, seed=7).state_dict()
    assert torch.equal(torch.rand(1), expected_next)
    b = build_unet(config, seed=7).state_dict()
    c = build_unet(config, seed=8).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["conv_in.weight"], c["conv_in.weight"])


def test_count_parameters_trainable_only():
    lin = torch.nn.Linear(3, 2)
    assert count_parameters(lin) == 8
    lin.bias.requires_grad_(False)
    assert count_parameters(lin, trainable_only=True) == 6


@pytest.mark.parametrize(("blocks", "factor"), [([16], 1), ([16, 32], 2), ([8, 16, 16], 4)])
def test_tiny_vae_downsamples_by_two_per_extra_block(blocks, factor):
    vae = build_tiny_vae(blocks, layers_per_block=1, latent_channels=4, seed=0)
    assert vae_downsample_factor(vae) == factor
    x = torch.rand(2, 3, 16, 16) * 2 - 1
    with torch.no_grad():
        z = vae.encode(x).latent_dist.mean
        y = vae.decode(z).sample
    assert z.shape == (2, 4, 16 // factor, 16 // factor)
    assert y.shape == x.shape
    assert vae.config.scaling_factor == 1.0
    # GroupNorm keeps >= 4 channels per group (one channel per group would erase flat colours)
    assert vae.config.norm_num_groups == {1: 4, 2: 4, 4: 2}[factor]


def test_tiny_vae_is_seeded():
    a = build_tiny_vae([16, 32], 1, 4, seed=3).state_dict()
    b = build_tiny_vae([16, 32], 1, 4, seed=3).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def _write_tokenizer_files(directory: Path, words: list[str]) -> dict[str, int]:
    vocab, merges = clip_vocab_and_merges(words)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "vocab.json").write_text(json.dumps(vocab))
    (directory / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    return vocab


def test_clip_vocab_layout():
    vocab, merges = clip_vocab_and_merges(DEMO_WORDS)
    assert sorted(vocab.values()) == list(range(len(vocab)))
    # 256 byte-level characters, then their </w> forms, then merged tokens, then the specials
    assert vocab["!"] == 0 and vocab["!</w>"] == 256
    assert vocab[BOS_TOKEN] == len(vocab) - 2 and vocab[EOS_TOKEN] == len(vocab) - 1
    for word in DEMO_WORDS:
        assert f"{word}</w>" in vocab
    assert merges[0] == "o n</w>"  # "a" is already a byte token; "on" is the first word needing a merge
    # one merge per extra character of each multi-letter word (no shared prefixes among these words
    # except b-a-c-k / b-l-a-c-k / b-l-u-e, which reuse merges)
    assert len(vocab) == 512 + len(merges) + 2


@pytest.mark.parametrize("cls", [CLIPTokenizer, CLIPTokenizerFast])
def test_every_demo_word_is_one_token_and_prompts_pad_to_77(tmp_path, cls):
    tricky = ["banana", "anana", "eeeee", "aaa", "aa", "café"]
    vocab = _write_tokenizer_files(tmp_path / "tok", DEMO_WORDS + tricky)
    tok = cls.from_pretrained(tmp_path / "tok", model_max_length=77)
    for word in DEMO_WORDS + tricky:
        ids = tok(word, add_special_tokens=False).input_ids
        assert len(ids) == 1 and tok.decode(ids) == word, (word, ids)
    assert tok("red", add_special_tokens=False).input_ids == [vocab["red</w>"]]
    assert vocab["cafÃ©</w>"] == tok("café", add_special_tokens=False).input_ids[0]  # byte-level form
    ids = tok("a red circle on a white background", padding="max_length", max_length=77, truncation=True).input_ids
    assert len(ids) == 77
    words = ["a", "red", "circle", "on", "a", "white", "background"]
    assert ids[:9] == [vocab[BOS_TOKEN], *(vocab[f"{w}</w>"] for w in words), vocab[EOS_TOKEN]]
    assert ids[9:] == [vocab[EOS_TOKEN]] * 68  # pad = <|endoftext|>, as in SD
    long = tok(" ".join(["red"] * 100), padding="max_length", max_length=77, truncation=True).input_ids
    assert len(long) == 77 and long[-1] == vocab[EOS_TOKEN]
    assert tok.decode(ids, skip_special_tokens=True) == "a red circle on a white background"


def test_clip_vocab_rejects_non_letters():
    with pytest.raises(ValueError, match="letters only.*'red2'"):
        clip_vocab_and_merges(["red2"])


def test_tiny_text_encoder_is_seeded_frozen_and_shaped():
    te = build_tiny_text_encoder(600, 32, 64, 2, 4, 77, seed=0)
    assert not any(p.requires_grad for p in te.parameters())
    assert not te.training
    assert te.config.eos_token_id == 599 and te.config.bos_token_id == 598
    ids = torch.tensor([[598, 300, 599] + [599] * 74])
    hidden = te(ids).last_hidden_state
    assert hidden.shape == (1, 77, 32)
    again = build_tiny_text_encoder(600, 32, 64, 2, 4, 77, seed=0)
    assert torch.equal(hidden, again(ids).last_hidden_state)
    with pytest.raises(ValueError, match=r"hidden_size \(30\) must be divisible by num_attention_heads \(4\)"):
        build_tiny_text_encoder(600, 30, 64, 2, 4, 77, seed=0)


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction"])
def test_noise_scheduler_matches_reference_schedule(prediction_type):
    sched = noise_scheduler(NoiseSchedule(prediction_type=prediction_type).model_dump())
    cfg = sched.config
    assert (cfg.num_train_timesteps, cfg.beta_start, cfg.beta_end) == (1000, 0.00085, 0.012)
    assert cfg.beta_schedule == "scaled_linear" and cfg.prediction_type == prediction_type
    assert cfg.clip_sample is False
    # scaled_linear: betas are linear in sqrt(beta)
    assert sched.betas[0].item() == pytest.approx(0.00085, rel=1e-5)
    assert sched.betas[-1].item() == pytest.approx(0.012, rel=1e-5)
    assert sched.betas[500].sqrt().item() == pytest.approx(
        (0.00085**0.5) + 500 / 999 * (0.012**0.5 - 0.00085**0.5), rel=1e-5
    )
