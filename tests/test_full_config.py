"""The shipped full-scale config validates and its UNet is exactly the SD1.x UNet."""

import torch

from model.builders import count_parameters, unet_config
from sdforge.config import load_params
from sdforge.ingest.buckets import shapes_of

SD1_UNET_PARAMS = 859_520_964


def test_full_config_loads_with_phase0_seven_phases_and_real_sources():
    p = load_params("configs/full/params.yaml")
    assert p.phase_names() == [f"phase{i}" for i in range(0, 8)]
    assert (p.phases["phase0"].init_from, p.phases["phase1"].init_from) == ("scratch", "phase0")
    assert [p.phase_resolution(n) for n in p.phases] == ["px256"] + ["px512"] * 7
    assert {k: shapes_of(v) for k, v in p.bucket_sets().items()} == {
        "px256": [(192, 320), (256, 256), (320, 192)],
        "px512": [(384, 640), (448, 576), (512, 512), (576, 448), (640, 384)],
    }
    assert {s.fetch.resize_mode for s in p.sources.values()} == {"keep_ratio"}  # encode crops into buckets
    assert {s.kind for s in p.sources.values()} == {"laion", "diffusiondb", "journeydb", "vggface2", "coco"}
    assert p.models.source == "pretrained"
    assert p.models.vae == "stabilityai/sd-vae-ft-mse"
    assert p.models.text_encoder == "openai/clip-vit-large-patch14"
    assert [p.phases[f"phase{i}"].lr for i in range(1, 8)] == [1e-5, 1e-5, 1e-5, 2e-6, 1.5e-6, 1e-6, 1e-6]
    assert [p.phases[f"phase{i}"].warmup_steps for i in range(1, 8)] == [500, 500, 500, 200, 150, 100, 150]
    assert [p.phases[f"phase{i}"].cfg_dropout for i in range(1, 8)] == [0.05] * 3 + [0.15] * 4
    assert p.phases["phase6"].mix == {"laion_hq": 0.6, "vggface2": 0.2, "coco": 0.2}
    effective = p.phases["phase1"].batch_size * p.train.nproc_per_node * p.phases["phase1"].grad_accum
    assert effective == 96


def test_full_unet_has_exactly_sd1_parameter_count():
    from diffusers import UNet2DConditionModel

    p = load_params("configs/full/params.yaml")
    with torch.device("meta"):
        unet = UNet2DConditionModel(**unet_config(p.models.unet.model_dump()))
    assert count_parameters(unet) == SD1_UNET_PARAMS
    assert next(unet.parameters()).device.type == "meta"


def test_the_mmdit_recipe_overlay_is_the_second_runs_and_fits_sd3s_two_clips():
    import yaml

    from model.denoisers import family
    from sdforge.architectures.frozen import architecture_config
    from sdforge.config import parse_params
    from tools.tiny_demo import merged

    base, overlay = (yaml.safe_load(open(f"configs/full/{n}.yaml")) for n in ("params", "mmdit"))
    p = parse_params(merged(base, overlay))
    mmdit = family(p.models.denoiser.family)
    config = mmdit.config(p.models.denoiser_spec)
    assert (config["num_layers"], config["num_attention_heads"] * config["attention_head_dim"]) == (19, 1216)
    assert sum(p.phases[n].samples * p.phases[n].epochs for n in ("phase0", "phase1")) == 348_400_000
    assert [p.phases[n].batch_size * p.train.nproc_per_node * p.phases[n].grad_accum for n in ("phase0", "phase1")] == [
        840,
        480,
    ]
    assert p.phases["phase0"].caption_dropout == {"text_encoder": 0.316, "text_encoder_2": 0.316, "pooled": 0.1}
    encoders = [architecture_config(h, "text_encoder") for h in (p.models.text_encoder, p.models.text_encoder_2)]
    mmdit.check_text_widths(config, [e["hidden_size"] for e in encoders], [e["projection_dim"] for e in encoders])
    assert {p.phase_objective(n) for n in p.phases} == {"flow_matching"}
    assert (p.phases["phase0"].flow_shift, p.phases["phase1"].flow_shift) == (1.0, 2.0)  # SD3's √(m / 256²)


def test_the_controlnet_overlay_trains_the_papers_canny_controlnet_on_the_frozen_phase7_unet():
    import yaml
    from diffusers import UNet2DConditionModel

    from model.denoisers import family
    from sdforge.config import parse_params
    from tools.tiny_demo import merged

    base, canny, lcm = (yaml.safe_load(open(f"configs/full/{n}.yaml")) for n in ("params", "controlnet", "distill"))
    p = parse_params(merged(merged(base, canny), lcm))  # beside the optional LCM phase
    phase = p.phases["phase8_canny"]
    assert (phase.init_from, phase.controlnet.condition, phase.cfg_dropout, phase.lr) == ("phase7", "canny", 0.5, 1e-5)
    assert p.conditions.kinds == ["canny"] and p.train.held_out > 0  # its eval grid scores held-out samples
    assert phase.samples // (phase.batch_size * p.train.nproc_per_node * phase.grad_accum) == 10_000
    with torch.device("meta"):
        unet = UNet2DConditionModel(**unet_config(p.models.unet.model_dump()))
        controlled = family("unet").controlled(unet, vae_factor=8, seed=0, scale=1.0)
    cn = controlled.controlnet
    added = sum(count_parameters(m) for m in (cn.controlnet_cond_embedding, cn.controlnet_down_blocks,
                                              cn.controlnet_mid_block))  # fmt: skip
    copied = sum(count_parameters(m) for m in (unet.conv_in, unet.time_embedding, unet.down_blocks, unet.mid_block))
    assert count_parameters(cn) - added == copied  # the whole SD 1.5 encoder and middle block, copied
    assert count_parameters(cn) == 361_279_120  # measured (docs/CONTROL.md)
    assert "phase8_canny" not in load_params("configs/full/params.yaml").phases  # off by default
