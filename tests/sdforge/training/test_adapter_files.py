"""An adapter phase's LoRA file: every adapted layer survives the round trip through diffusers' loader."""

import pytest
import torch
from safetensors.torch import load_file

from model.adapters import UNET_GROUPS, add_adapter, lora_config, target_pattern
from model.builders import build_unet, unet_config
from sdforge.eval.sampling import load_lora
from sdforge.training.adapter_files import LORA_FILE, write_lora_folder
from tests.fixtures.training import TRAIN_UNET


def _randomised(unet: torch.nn.Module, seed: int) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in unet.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return unet.eval()


@pytest.mark.parametrize("kind", ["lora", "dora"])
def test_a_lora_on_attention_and_other_layers_loads_whole(tmp_path, kind):
    """Attention projections next to ``proj`` / ``feed_forward`` / ``time_embedding``: with diffusers' key renaming
    the attention half was silently dropped on load (the first key decided the format)."""
    groups = ["self_attention", "cross_attention", "feed_forward", "proj", "time_embedding"]
    config = lora_config(kind, 2, None, 0.0, target_pattern(groups, UNET_GROUPS))
    trained = _randomised(build_unet(unet_config(TRAIN_UNET), 0), 0)
    add_adapter(trained, config)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(1)
        for name, p in trained.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    path = write_lora_folder(trained, tmp_path / "adapter")
    assert path.name == LORA_FILE and not any(".lora.down" in k for k in load_file(path))
    loaded = _randomised(build_unet(unet_config(TRAIN_UNET), 0), 0)
    load_lora(loaded, tmp_path / "adapter")
    adapted = {n.split(".lora_A")[0] for n, _ in trained.named_parameters() if ".lora_A." in n}
    assert adapted == {n.split(".lora_A")[0] for n, _ in loaded.named_parameters() if ".lora_A." in n}
    assert any("attn1.to_q" in n for n in adapted) and any("time_emb_proj" in n for n in adapted)
    x, t = torch.randn(1, 4, 8, 8), torch.tensor([500])
    ctx = torch.randn(1, 77, TRAIN_UNET["cross_attention_dim"])
    with torch.no_grad():
        want = trained(x, t, encoder_hidden_states=ctx).sample
        got = loaded(x, t, encoder_hidden_states=ctx).sample
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
