"""Adapters: the layer groups' module names, LoRA vs DoRA, exact merge and restore, the plain state dict."""

import pytest
import torch
from diffusers import UNet2DConditionModel

from model.adapters import (
    UNET_GROUPS,
    add_adapter,
    count_parameters,
    lora_config,
    merged,
    plain_state_dict,
    target_pattern,
)
from model.builders import build_unet, unet_config
from tests.fixtures.training import TRAIN_UNET

# TRAIN_UNET: one CrossAttnDownBlock2D (1 transformer block), the mid block (1), one CrossAttnUpBlock2D (2)
BLOCKS = 4


def _unet(seed: int = 0) -> UNet2DConditionModel:
    unet = build_unet(unet_config(TRAIN_UNET), seed)
    with torch.no_grad():  # the built UNet's output layer is zero: give every weight a value
        gen = torch.Generator().manual_seed(seed)
        for p in unet.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return unet.eval()


def _adapted_names(groups: list[str]) -> set[str]:
    unet = _unet()
    add_adapter(unet, lora_config("lora", 2, None, 0.0, target_pattern(groups, UNET_GROUPS)))
    return {n.split(".lora_A")[0] for n, _ in unet.named_parameters() if ".lora_A." in n}


@pytest.mark.parametrize(
    ("group", "suffixes", "per_block"),
    [
        ("self_attention", {"attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0"}, 4),
        ("cross_attention", {"attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0"}, 4),
        ("feed_forward", {"ff.net.0.proj", "ff.net.2"}, 2),
        ("proj", {"proj_in", "proj_out"}, 2),
    ],
)
def test_each_group_adapts_exactly_its_modules(group, suffixes, per_block):
    names = _adapted_names([group])
    assert len(names) == BLOCKS * per_block
    for suffix in suffixes:  # each module of the group, once in every transformer block, and nothing else
        assert sum(n.endswith("." + suffix) for n in names) == BLOCKS, suffix


@pytest.mark.parametrize("groups", [["time_embedding"], ["pooled_text"], ["time_embedding", "pooled_text"]])
def test_time_embedding_and_pooled_text_adapt_the_time_projections_and_the_pooled_prompts_path(groups):
    unet = build_unet(unet_config({**TRAIN_UNET, "addition_embed_type": "text", "addition_embed_type_num_heads": 2}), 0)
    resnets = [n for n, _ in unet.named_modules() if n.split(".")[-2:-1] == ["resnets"]]
    add_adapter(unet, lora_config("lora", 2, None, 0.0, target_pattern(groups, UNET_GROUPS)))
    names = {n.split(".lora_A")[0] for n, _ in unet.named_parameters() if ".lora_A." in n}
    expected = {
        "time_embedding": {f"{r}.time_emb_proj" for r in resnets},  # every ResNet's, nothing else
        "pooled_text": {f"add_embedding.{m}" for m in ("proj", "pool.q_proj", "pool.k_proj", "pool.v_proj")},
    }
    assert len(resnets) >= 4 and names == set().union(*(expected[g] for g in groups))


def test_resnet_conv_adapts_every_resnets_two_convolutions_and_nothing_else():
    names = _adapted_names(["resnet_conv"])
    unet = _unet()
    resnets = [n for n, _ in unet.named_modules() if n.split(".")[-2:-1] == ["resnets"]]
    assert names == {f"{r}.{c}" for r in resnets for c in ("conv1", "conv2")}


def test_an_unknown_group_is_refused_by_name():
    with pytest.raises(ValueError, match=r"unknown adapter target group\(s\) \['mlp'\]"):
        target_pattern(["mlp"], UNET_GROUPS)


@pytest.mark.parametrize("kind", ["lora", "dora"])
def test_only_the_adapter_trains_and_it_starts_as_the_identity(kind):
    unet, base = _unet(), _unet()
    x, t, c = torch.randn(2, 4, 8, 8), torch.tensor([10, 700]), torch.randn(2, 16, TRAIN_UNET["cross_attention_dim"])
    trainable = add_adapter(unet, lora_config(kind, 4, 8, 0.0, target_pattern(["self_attention"], UNET_GROUPS)))
    names = [n for n, _ in trainable]
    assert all(".lora_" in n for n in names)
    assert any("lora_magnitude_vector" in n for n in names) == (kind == "dora")
    n_train, n_base = count_parameters(unet)
    assert n_base == sum(p.numel() for p in base.parameters())
    assert n_train == sum(p.numel() for _, p in trainable) and n_train < 0.05 * n_base
    with torch.no_grad():
        assert torch.equal(unet(x, t, encoder_hidden_states=c).sample, base(x, t, encoder_hidden_states=c).sample)


@pytest.mark.parametrize("kind", ["lora", "dora"])
def test_merged_weights_give_the_adapters_output_and_the_base_comes_back_bit_for_bit(kind):
    unet = _unet()
    before = {k: v.clone() for k, v in unet.state_dict().items()}
    trainable = add_adapter(
        unet, lora_config(kind, 4, 8, 0.0, target_pattern(["cross_attention", "proj"], UNET_GROUPS))
    )
    with torch.no_grad():
        for name, p in trainable:
            if "lora_B" in name:
                p.normal_(0, 0.2, generator=torch.Generator().manual_seed(1))
    x, t, c = torch.randn(2, 4, 8, 8), torch.tensor([10, 700]), torch.randn(2, 16, TRAIN_UNET["cross_attention_dim"])
    with torch.no_grad():
        adapted = unet(x, t, encoder_hidden_states=c).sample
        with merged(unet):
            merged_out = unet(x, t, encoder_hidden_states=c).sample
            plain = {k: v.clone() for k, v in plain_state_dict(unet).items()}
        fresh = UNet2DConditionModel.from_config(unet.config).eval()
        fresh.load_state_dict(plain, strict=True)
        fresh_out = fresh(x, t, encoder_hidden_states=c).sample
    assert float((adapted - before_out(before, x, t, c)).abs().max()) > 1e-3  # the adapter does something
    assert float((merged_out - adapted).abs().max()) < 1e-5
    assert float((fresh_out - adapted).abs().max()) < 1e-5
    after = plain_state_dict(unet)
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)


def before_out(state: dict, x, t, c) -> torch.Tensor:
    """The base UNet's output, rebuilt from ``state``."""
    base = UNet2DConditionModel.from_config(unet_config(TRAIN_UNET)).eval()
    base.load_state_dict(state)
    with torch.no_grad():
        return base(x, t, encoder_hidden_states=c).sample


def test_a_pattern_that_matches_nothing_is_a_clear_error():
    no_attention = {
        "down_block_types": ["DownBlock2D"] * 2,
        "up_block_types": ["UpBlock2D"] * 2,
        "mid_block_type": None,
    }
    unet = UNet2DConditionModel.from_config({**unet_config(TRAIN_UNET), **no_attention})
    with pytest.raises(ValueError, match="match no layer|added no trainable"):
        add_adapter(unet, lora_config("lora", 2, None, 0.0, target_pattern(["cross_attention"], UNET_GROUPS)))


def test_the_params_target_names_are_exactly_the_groups_mapped_here():
    from model.denoisers import FAMILIES
    from sdforge.config import ADAPTER_TARGETS
    from sdforge.config.phases import FAMILY_ADAPTER_TARGETS

    assert {name: sorted(f.lora_groups) for name, f in FAMILIES.items()} == {
        name: sorted(groups) for name, groups in FAMILY_ADAPTER_TARGETS.items()
    }
    assert sorted(ADAPTER_TARGETS) == sorted({g for f in FAMILIES.values() for g in f.lora_groups})


def test_the_configs_capability_tables_are_the_families():
    from model.denoisers import FAMILIES
    from model.text_stack import text_part_dirs
    from sdforge.config.params import FAMILY_OBJECTIVES, FAMILY_TEXT_ENCODERS
    from sdforge.config.phases import FAMILY_CAPTION_PARTS

    assert FAMILY_OBJECTIVES == {name: f.objectives for name, f in FAMILIES.items()}
    assert FAMILY_TEXT_ENCODERS == {name: tuple(d for d, _ in text_part_dirs(f)) for name, f in FAMILIES.items()}
    parts = {name: tuple(p.name for p in f.cond_parts([8] * f.text_encoders, [8] * f.text_encoders, 4))
             for name, f in FAMILIES.items()}  # fmt: skip
    assert FAMILY_CAPTION_PARTS == parts
    assert all(len(f.text_encoder_classes) == f.text_encoders for f in FAMILIES.values())
