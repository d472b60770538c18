"""sdforge.architectures: the real SD 1.x VAE and CLIP-L text encoder with seeded random weights; CLIP's tokenizer."""

from __future__ import annotations

import pytest
import torch
from transformers import CLIPTokenizer

from sdforge import architectures
from sdforge.architectures import (
    build_random_text_encoder,
    build_random_vae,
    known_architectures,
    write_clip_tokenizer,
)
from sdforge.config import ConfigError

VAE_ID, CLIP_ID = "stabilityai/sd-vae-ft-mse", "openai/clip-vit-large-patch14"
BIGG_ID = "laion/CLIP-ViT-bigG-14-laion2B-39B-b160k"
"""The second text encoder of the mmdit family (SD3's OpenCLIP ViT-bigG/14)."""
SDXL_VAE_IDS = ["madebyollin/sdxl-vae-fp16-fix", "stabilityai/sdxl-vae"]
"""SDXL's VAE and its fp16-safe fine-tune (docs/SDXL.md "The VAE's precision")."""
VAE_IDS = sorted([VAE_ID, *SDXL_VAE_IDS])


def _n_params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> CLIPTokenizer:
    return write_clip_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="module")
def vae():
    return build_random_vae(VAE_ID, 0)


@pytest.fixture(scope="module")
def text_encoder():
    return build_random_text_encoder(CLIP_ID, 0)


def test_known_architectures_are_keyed_by_hub_id():
    assert known_architectures() == sorted([BIGG_ID, CLIP_ID, *VAE_IDS])
    assert known_architectures("vae") == VAE_IDS and known_architectures("text_encoder") == [BIGG_ID, CLIP_ID]


def test_the_sdxl_vaes_are_sds_architecture_with_sdxls_scaling_and_only_the_fix_runs_in_fp16():
    with torch.device("meta"):
        sd, sdxl, fix = (build_random_vae(hub_id, 0) for hub_id in (VAE_ID, *SDXL_VAE_IDS[::-1]))
    assert _n_params(sdxl) == _n_params(fix) == _n_params(sd)
    assert sdxl.config.scaling_factor == fix.config.scaling_factor == 0.13025
    assert sdxl.config.force_upcast and not fix.config.force_upcast


def test_bigg_is_built_with_its_real_size_and_projection():
    from transformers import CLIPTextModelWithProjection

    with torch.device("meta"):
        bigg = build_random_text_encoder(BIGG_ID, 0, CLIPTextModelWithProjection)
    assert (bigg.config.hidden_size, bigg.config.num_hidden_layers, bigg.config.projection_dim) == (1280, 32, 1280)
    assert _n_params(bigg) == 694_659_840  # OpenCLIP ViT-bigG/14's text tower + projection


def test_tokenizer_gives_clips_real_ids(tokenizer, tmp_path_factory):
    assert tokenizer("a photo of a cat").input_ids == [49406, 320, 1125, 539, 320, 2368, 49407]
    assert len(tokenizer) == 49408 and tokenizer.model_max_length == 77
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (49406, 49407, 49407)
    padded = tokenizer("a photo of a cat", padding="max_length", max_length=77).input_ids
    assert len(padded) == 77 and padded[7:] == [49407] * 70
    saved = CLIPTokenizer.from_pretrained(tokenizer.name_or_path)  # save_pretrained wrote a loadable folder
    assert saved("a photo of a cat").input_ids == tokenizer("a photo of a cat").input_ids
    assert write_clip_tokenizer(tmp_path_factory.mktemp("short"), max_length=16).model_max_length == 16


def test_tokenizer_without_open_clip_names_the_install_command(monkeypatch, tmp_path):
    monkeypatch.setattr(architectures.clip_tokenizer.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match=r"pip install --no-deps open-clip-torch==3\.3\.0.*make venv"):
        write_clip_tokenizer(tmp_path)


def test_random_vae_is_sd_vae_ft_mse(vae):
    assert _n_params(vae) == 83_653_863
    assert vae.config.scaling_factor == pytest.approx(0.18215)
    assert list(vae.config.block_out_channels) == [128, 256, 512, 512] and vae.config.latent_channels == 4
    assert not vae.training and not any(p.requires_grad for p in vae.parameters())
    with torch.no_grad():
        dist = vae.encode(torch.zeros(1, 3, 64, 64)).latent_dist
    assert dist.mean.shape == (1, 4, 8, 8) and dist.std.shape == (1, 4, 8, 8)


def test_random_text_encoder_is_clip_l(text_encoder, tokenizer):
    assert _n_params(text_encoder) == 123_060_480
    assert text_encoder.config.hidden_act == "quick_gelu" and text_encoder.config.eos_token_id == 49407
    ids = tokenizer("a photo of a cat", padding="max_length", max_length=77, return_tensors="pt").input_ids
    with torch.no_grad():
        out = text_encoder(ids)
    assert out.last_hidden_state.shape == (1, 77, 768)
    # pooled at the first <|endoftext|> (index 6), as the real model's argmax pooling does
    assert torch.equal(out.pooler_output[0], out.last_hidden_state[0, 6])


def test_same_seed_same_weights_other_seed_other_weights(text_encoder):
    def embedding(seed: int) -> torch.Tensor:
        return build_random_text_encoder(CLIP_ID, seed).get_input_embeddings().weight

    weight = text_encoder.get_input_embeddings().weight
    assert torch.equal(embedding(0), weight)
    assert not torch.equal(embedding(1), weight)
    state = torch.random.get_rng_state()
    build_random_vae(VAE_ID, 3)
    assert torch.equal(torch.random.get_rng_state(), state)  # the caller's RNG is left alone


@pytest.mark.parametrize(
    ("build", "hub_id", "key"),
    [
        (build_random_vae, "someone/unknown-vae", "models.vae"),
        (build_random_text_encoder, "someone/unknown-clip", "models.text_encoder"),
        (build_random_vae, CLIP_ID, "models.vae"),  # a text config is not a VAE
    ],
)
def test_unknown_id_names_the_id_the_key_and_the_known_ids(build, hub_id, key):
    with pytest.raises(ConfigError) as err:
        build(hub_id, 0)
    message = str(err.value)
    assert message.startswith(key + ":") and repr(hub_id) in message
    known = VAE_IDS if key == "models.vae" else [BIGG_ID, CLIP_ID]
    assert repr(known) in message
