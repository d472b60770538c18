"""The denoiser seam (model/denoisers/): the MM-DiT family's build, conditioning layout, caption-part dropout and
the pipeline's own prompt encoding; the registry."""

from __future__ import annotations

import pytest
import torch
from transformers import CLIPTextConfig, CLIPTextModelWithProjection, CLIPTokenizer

from model.denoisers import FAMILIES, family, family_for_config, family_of
from model.denoisers.mmdit import pack, unpack
from model.diffusion import part_dropout
from model.text_stack import TextStack
from sdforge.demo.models import write_demo_tokenizer
from tests.fixtures.training import TRAIN_MMDIT

MMDIT = family("mmdit")
WORDS = ["a", "red", "green", "circle", "square", "on", "white", "black", "background"]


def _encoder(seed: int, vocab: int, width: int = 32) -> CLIPTextModelWithProjection:
    config = CLIPTextConfig(vocab_size=vocab, hidden_size=width, intermediate_size=2 * width, num_hidden_layers=2,
                            num_attention_heads=2, max_position_embeddings=16, projection_dim=width,
                            bos_token_id=vocab - 2, eos_token_id=vocab - 1, pad_token_id=vocab - 1)  # fmt: skip
    torch.manual_seed(seed)
    return CLIPTextModelWithProjection(config).eval()


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    """Two tokenizers over one vocabulary (the second pads with ``!``, as SD3's bigG one) and two encoders."""
    root = tmp_path_factory.mktemp("text")
    first = write_demo_tokenizer(WORDS, root / "tokenizer", 16)
    second = CLIPTokenizer.from_pretrained(root / "tokenizer", pad_token="!")
    return TextStack(MMDIT, [first, second], [_encoder(0, len(first)), _encoder(1, len(first))])


def test_a_built_mmdit_is_seeded_and_starts_at_zero_output():
    a, b = (MMDIT.build(MMDIT.config(TRAIN_MMDIT), seed=3) for _ in range(2))
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))
    cond = torch.randn(2, 17, 64)
    out = MMDIT.predict(a, torch.randn(2, 4, 8, 8), torch.tensor([100.0, 900.0]), cond)
    assert out.shape == (2, 4, 8, 8) and torch.count_nonzero(out) == 0  # adaLN-Zero: every block the identity
    assert family_of(a) is MMDIT and family_for_config("SD3Transformer2DModel", {}) is MMDIT


def test_spec_and_text_width_errors_name_the_key():
    with pytest.raises(ValueError, match="missing: \\['qk_norm'\\]"):
        MMDIT.config({k: v for k, v in TRAIN_MMDIT.items() if k != "qk_norm"})
    with pytest.raises(ValueError, match="^pooled_projection_dim \\(64\\)"):
        MMDIT.check_text_widths(TRAIN_MMDIT, [32, 32], [32, 48])
    with pytest.raises(ValueError, match="^joint_attention_dim \\(64\\)"):
        MMDIT.check_text_widths(TRAIN_MMDIT, [32, 48], [32, 32])
    with pytest.raises(ValueError, match="unknown denoiser family 'dit'"):
        family("dit")


def test_pack_then_unpack_gives_the_pipelines_two_inputs():
    sequence, pooled = torch.randn(3, 16, 40), torch.randn(3, 64)
    got_sequence, got_pooled = unpack(pack(sequence, pooled), joint_dim=96, pooled_dim=64)
    assert torch.equal(got_sequence[..., :40], sequence) and torch.count_nonzero(got_sequence[..., 40:]) == 0
    assert got_sequence.shape == (3, 16, 96) and torch.equal(got_pooled, pooled)


def test_the_second_tokenizers_ids_are_its_own(text):
    prompts = ["a red circle on a white background", ""]
    stored = text.tokenize(prompts)
    own = text.tokenizers[1](prompts, padding="max_length", max_length=16, truncation=True, return_tensors="pt")
    first, second = text.ids_per_encoder(stored)
    assert torch.equal(first, stored) and torch.equal(second, own.input_ids)
    assert not torch.equal(first, second)  # the pads differ: the conversion did something


def test_the_packed_conditioning_equals_sd3_pipelines_prompt_encoding(text):
    from diffusers import StableDiffusion3Pipeline

    transformer = MMDIT.build(MMDIT.config(TRAIN_MMDIT), seed=0)
    pipe = StableDiffusion3Pipeline(transformer=transformer, scheduler=None, vae=None, text_encoder=text.encoders[0],
                                    tokenizer=text.tokenizers[0], text_encoder_2=text.encoders[1],
                                    tokenizer_2=text.tokenizers[1], text_encoder_3=None, tokenizer_3=None)  # fmt: skip
    prompts = ["a green square on a black background", "a red circle"]
    sequence, _, pooled, _ = pipe.encode_prompt(prompts, prompts, prompts, device="cpu",
                                                do_classifier_free_guidance=False, max_sequence_length=0)  # fmt: skip
    got_sequence, got_pooled = unpack(text.encode_prompts(prompts), joint_dim=64, pooled_dim=64)
    torch.testing.assert_close(got_sequence, sequence, rtol=0, atol=0)
    torch.testing.assert_close(got_pooled, pooled, rtol=0, atol=0)


def test_caption_parts_drop_alone_and_at_their_rates(text):
    parts = {p.name: p for p in text.parts()}
    assert list(parts) == ["text_encoder", "text_encoder_2", "pooled"]
    cond, uncond = torch.ones(4000, 17, 64), torch.zeros(1, 17, 64)
    gens = [torch.Generator().manual_seed(i) for i in range(4000)]
    dropped = part_dropout(cond, uncond, [(parts["text_encoder"], 0.316), (parts["pooled"], 0.1)], gens)
    first = dropped[:, 0, 0] == 0  # encoder 1's sequence region
    pooled = dropped[:, 16, 0] == 0
    assert torch.all(dropped[:, :16, 32:] == 1)  # encoder 2's region never touched
    assert torch.all(dropped[first][:, :16, :32] == 0) and torch.all(dropped[~first][:, :16, :32] == 1)
    assert abs(first.float().mean().item() - 0.316) < 0.03 and abs(pooled.float().mean().item() - 0.1) < 0.02
    assert abs((first & pooled).float().mean().item() - 0.0316) < 0.012  # independent draws
    assert torch.equal(part_dropout(cond, uncond, [], gens), cond)


def test_flops_grow_with_the_image_tokens_and_every_family_is_registered():
    config = MMDIT.config(TRAIN_MMDIT)
    small, large = MMDIT.flops_per_sample(config, 8, 17, 64), MMDIT.flops_per_sample(config, 16, 17, 64)
    assert 3.0 < large / small < 5.0  # 16 → 64 image tokens (+16 text): the linear layers dominate at this size
    assert sorted(FAMILIES) == ["mmdit", "sdxl", "unet"]
