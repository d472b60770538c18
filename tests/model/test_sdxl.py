"""The SDXL family (model/denoisers/sdxl.py): its conditioning equals ``StableDiffusionXLPipeline``'s prompt encoding,
the micro-conditioning row reaches the UNet, the registry tells it from the SD 1.x UNet, and the sampler draws the
pipeline's latents."""

from __future__ import annotations

import pytest
import torch
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

from model.denoisers import family, family_for_config, family_of, uncropped_sizes
from model.denoisers.sdxl import pack, unpack
from model.diffusion import part_dropout
from model.sampler import ddim_from_training, sample_latents
from model.text_stack import TextStack
from sdforge.demo.models import write_demo_tokenizer
from tests.fixtures.training import TRAIN_SDXL, TRAIN_UNET

SDXL = family("sdxl")
WORDS = ["a", "red", "green", "circle", "square", "on", "white", "black", "background"]
TRAIN_SCHEDULER = {"num_train_timesteps": 1000, "beta_start": 0.00085, "beta_end": 0.012,
                   "beta_schedule": "scaled_linear", "prediction_type": "epsilon"}  # fmt: skip


def _config(vocab: int, width: int = 32) -> CLIPTextConfig:
    return CLIPTextConfig(vocab_size=vocab, hidden_size=width, intermediate_size=2 * width, num_hidden_layers=2,
                          num_attention_heads=2, max_position_embeddings=16, projection_dim=width,
                          bos_token_id=vocab - 2, eos_token_id=vocab - 1, pad_token_id=vocab - 1)  # fmt: skip


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    """CLIP-L's and bigG's stand-ins: one vocabulary, the second pads with ``!`` and has a projection."""
    root = tmp_path_factory.mktemp("text")
    first = write_demo_tokenizer(WORDS, root / "tokenizer", 16)
    second = CLIPTokenizer.from_pretrained(root / "tokenizer", pad_token="!")
    torch.manual_seed(0)
    plain = CLIPTextModel(_config(len(first))).eval()
    torch.manual_seed(1)
    projected = CLIPTextModelWithProjection(_config(len(first))).eval()
    return TextStack(SDXL, [first, second], [plain, projected])


@pytest.fixture(scope="module")
def unet():
    model = SDXL.build(SDXL.config(TRAIN_SDXL), seed=3)
    with torch.no_grad():  # the build zeroes the output layers: give them weights so the output depends on inputs
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.02)
    return model.eval()


def test_the_registry_tells_an_sdxl_unet_from_an_sd1_unet(unet):
    sd1 = family("unet").build(family("unet").config(TRAIN_UNET), seed=0)
    assert family_of(unet) is SDXL and family_of(sd1) is family("unet")
    assert family_for_config("UNet2DConditionModel", dict(unet.config)) is SDXL
    assert family_for_config("UNet2DConditionModel", dict(sd1.config)) is family("unet")
    a, b = (SDXL.build(SDXL.config(TRAIN_SDXL), seed=5) for _ in range(2))
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))


def test_spec_and_text_width_errors_name_the_key():
    with pytest.raises(ValueError, match="missing: \\['use_linear_projection'\\]"):
        SDXL.config({k: v for k, v in TRAIN_SDXL.items() if k != "use_linear_projection"})
    with pytest.raises(ValueError, match="^cross_attention_dim \\(64\\)"):
        SDXL.check_text_widths(TRAIN_SDXL, [32, 48], [32, 32])
    with pytest.raises(ValueError, match="^projection_class_embeddings_input_dim \\(80\\).* = 96"):
        SDXL.check_text_widths(TRAIN_SDXL, [32, 32], [32, 48])


def test_the_packed_conditioning_equals_sdxl_pipelines_prompt_encoding(text, unet):
    from diffusers import StableDiffusionXLPipeline

    pipe = StableDiffusionXLPipeline(vae=None, text_encoder=text.encoders[0], text_encoder_2=text.encoders[1],
                                     tokenizer=text.tokenizers[0], tokenizer_2=text.tokenizers[1], unet=unet,
                                     scheduler=None, add_watermarker=False)  # fmt: skip
    prompts = ["a green square on a black background", "a red circle"]
    sequence, _, pooled, _ = pipe.encode_prompt(prompts, device="cpu", do_classifier_free_guidance=False)
    packed = text.encode_prompts(prompts)
    assert packed.shape == (2, 16 + 2, 64) and torch.count_nonzero(packed[:, -1]) == 0  # the sizes row starts at 0
    got_sequence, got_pooled, _ = unpack(packed, cross_dim=64, pooled_dim=32)
    torch.testing.assert_close(got_sequence, sequence, rtol=0, atol=0)
    torch.testing.assert_close(got_pooled, pooled, rtol=0, atol=0)


def test_sized_writes_the_time_ids_the_unet_reads(unet):
    sequence, pooled = torch.randn(2, 16, 64), torch.randn(2, 32)
    sizes = torch.tensor([[512.0, 384, 0, 16, 256, 256], [300, 200, 8, 0, 256, 256]])
    cond = SDXL.sized(pack(sequence, pooled), sizes)
    assert torch.equal(unpack(cond, 64, 32)[2], sizes) and torch.equal(unpack(cond, 64, 32)[0], sequence)
    x, t = torch.randn(2, 4, 8, 8), torch.tensor([10, 700])
    direct = unet(x, t, encoder_hidden_states=sequence, added_cond_kwargs={"text_embeds": pooled, "time_ids": sizes})
    with torch.no_grad():
        torch.testing.assert_close(SDXL.predict(unet, x, t, cond), direct.sample.detach(), rtol=0, atol=0)
        other = SDXL.predict(unet, x, t, SDXL.sized(cond, uncropped_sizes(256, 256)))
    assert (other - direct.sample).abs().max() > 1e-4  # the sizes change the output
    assert torch.equal(family("unet").sized(cond, sizes), cond)  # a family without micro-conditioning ignores them


def test_caption_parts_leave_the_sizes_row_alone(text):
    parts = {p.name: p for p in text.parts()}
    assert list(parts) == ["text_encoder", "text_encoder_2", "pooled"]
    cond, uncond = torch.ones(64, 18, 64), torch.zeros(1, 18, 64)
    gens = [torch.Generator().manual_seed(i) for i in range(64)]
    dropped = part_dropout(cond, uncond, [(p, 1.0) for p in parts.values()], gens)
    assert torch.count_nonzero(dropped[:, :17, :32]) == 0 and torch.count_nonzero(dropped[:, :16, 32:]) == 0
    assert torch.all(dropped[:, 16, 32:] == 1) and torch.all(dropped[:, 17] == 1)


def test_the_sampler_draws_the_sdxl_pipelines_latents(text, unet):
    from diffusers import StableDiffusionXLPipeline

    pipe = StableDiffusionXLPipeline(vae=None, text_encoder=text.encoders[0], text_encoder_2=text.encoders[1],
                                     tokenizer=text.tokenizers[0], tokenizer_2=text.tokenizers[1], unet=unet,
                                     scheduler=ddim_from_training(TRAIN_SCHEDULER), force_zeros_for_empty_prompt=False,
                                     add_watermarker=False)  # fmt: skip
    prompts, seeds = ["a red circle on a white background", "a green square"], [4, 9]  # no VAE: the pipeline's ×8
    with torch.no_grad():
        theirs = pipe(prompts, negative_prompt=["", ""], height=64, width=64, num_inference_steps=4,
                      guidance_scale=3.0, generator=[torch.Generator().manual_seed(s) for s in seeds],
                      output_type="latent").images  # fmt: skip
    ours = sample_latents(unet, ddim_from_training(TRAIN_SCHEDULER), text.encode_prompts(prompts),
                          text.encode_prompts(["", ""]), steps=4, guidance_scale=3.0, latent_shape=(4, 8, 8),
                          generators=[torch.Generator().manual_seed(s) for s in seeds], image_px=(64, 64))  # fmt: skip
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
