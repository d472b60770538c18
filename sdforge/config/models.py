"""``models``: the frozen VAE and text encoder (built for the demo, or pretrained), the UNet architecture, the
noise schedule and the demo's captioner."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from sdforge.config.base import Section, Url


class VaeBuild(Section):
    """A small AutoencoderKL built and trained locally (demo)."""

    block_out_channels: list[int] = [32, 64]
    layers_per_block: int = 1
    latent_channels: int = 4
    train_steps: int = Field(400, ge=0)
    batch_size: int = Field(32, ge=1)
    lr: float = Field(1e-3, gt=0)
    kl_weight: float = Field(1e-6, ge=0)


class TextEncoderBuild(Section):
    """A tiny random CLIP text encoder + a tokenizer whose vocabulary covers the demo words."""

    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    max_position_embeddings: int = 77
    seed: int | None = None
    """The text encoder's build seed (its random draw); null: ``models.seed``. The demo's prompt following must
    hold for any draw: ``bench.demo_quality --text-encoder-seeds`` measures two."""


class UNetSpec(Section):
    """The keys of the diffusers UNet's config that this project sets (the unet family, ``model/denoisers/unet.py``)."""

    sample_size: int = 64
    in_channels: int = 4
    out_channels: int = 4
    block_out_channels: list[int] = [320, 640, 1280, 1280]
    layers_per_block: int = 2
    down_block_types: list[str] = [
        "CrossAttnDownBlock2D",
        "CrossAttnDownBlock2D",
        "CrossAttnDownBlock2D",
        "DownBlock2D",
    ]
    up_block_types: list[str] = [
        "UpBlock2D",
        "CrossAttnUpBlock2D",
        "CrossAttnUpBlock2D",
        "CrossAttnUpBlock2D",
    ]
    cross_attention_dim: int = 768
    attention_head_dim: int = 8
    norm_num_groups: int = 32
    addition_embed_type: Literal["text"] | None = None
    """``text``: the prompt's embedding, attention-pooled (diffusers ``TextTimeEmbedding``), is also added to
    the timestep embedding, so every ResNet block sees the prompt (the pooled-text conditioning of Imagen
    and SDXL). SD 1.x has none (null); the demo uses it (README "The embedded demo")."""
    addition_embed_type_num_heads: int = Field(64, ge=1)
    """Heads of that attention pooling (``cross_attention_dim`` must divide by it)."""

    @model_validator(mode="after")
    def _block_lists_match(self) -> UNetSpec:
        n = len(self.block_out_channels)
        if len(self.down_block_types) != n or len(self.up_block_types) != n:
            raise ValueError(
                f"down_block_types ({len(self.down_block_types)}) and up_block_types "
                f"({len(self.up_block_types)}) must each have one entry per block_out_channels ({n})"
            )
        return self


class SDXLSpec(Section):
    """The keys of SDXL's UNet config this project sets (``models.denoiser.family: sdxl``, ``model/denoisers/sdxl.py``;
    ``addition_embed_type`` is ``text_time``). The defaults are ``stabilityai/stable-diffusion-xl-base-1.0``'s UNet
    (2,567,463,684 parameters)."""

    sample_size: int = 128
    in_channels: int = 4
    out_channels: int = 4
    block_out_channels: list[int] = [320, 640, 1280]
    layers_per_block: int = 2
    down_block_types: list[str] = ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"]
    up_block_types: list[str] = ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"]
    cross_attention_dim: int = 2048
    """The two encoders' penultimate hidden states side by side (CLIP-L 768 + bigG 1280)."""
    attention_head_dim: list[int] = [5, 10, 20]
    """Per block: diffusers' name for SDXL's head counts (each head is 64 wide)."""
    transformer_layers_per_block: list[int] = [1, 2, 10]
    norm_num_groups: int = 32
    use_linear_projection: bool = True
    addition_time_embed_dim: int = Field(256, ge=1)
    """Width of each of the six micro-conditioning numbers' sinusoidal embeddings."""
    projection_class_embeddings_input_dim: int = Field(2816, ge=1)
    """bigG's pooled projection (1280) + 6 × ``addition_time_embed_dim``."""

    @model_validator(mode="after")
    def _block_lists_match(self) -> SDXLSpec:
        n = len(self.block_out_channels)
        lists = {"down_block_types": self.down_block_types, "up_block_types": self.up_block_types,
                 "attention_head_dim": self.attention_head_dim,
                 "transformer_layers_per_block": self.transformer_layers_per_block}  # fmt: skip
        wrong = {k: len(v) for k, v in lists.items() if len(v) != n}
        if wrong:
            raise ValueError(f"{wrong} must each have one entry per block_out_channels ({n})")
        return self


MMDIT_PRESETS: dict[str, dict] = {
    "1.2b": {"num_layers": 19, "attention_head_dim": 64, "num_attention_heads": 19, "caption_projection_dim": 1216},
    "2b": {"num_layers": 24, "attention_head_dim": 64, "num_attention_heads": 24, "caption_projection_dim": 1536},
}
"""Size presets of ``models.mmdit``: the second public run's ~1.2B (19 blocks, width 64×19) and an SD3-medium-like
~2B (24 blocks, width 64×24); a key set beside ``preset`` overrides it (docs/MMDIT.md)."""


class MMDiTSpec(Section):
    """The keys of SD3's transformer config this project sets (``models.denoiser.family: mmdit``,
    ``model/denoisers/mmdit.py``)."""

    preset: Literal["1.2b", "2b"] | None = None
    sample_size: int = Field(64, ge=1)
    """Latent side it is built for (64: 512 px with SD's VAE)."""
    patch_size: int = Field(2, ge=1)
    in_channels: int = Field(4, ge=1)
    """The VAE's latent channels: 4 (SD's), 16 (FLUX.1's)."""
    out_channels: int = Field(4, ge=1)
    num_layers: int = Field(19, ge=1)
    attention_head_dim: int = Field(64, ge=1)
    num_attention_heads: int = Field(19, ge=1)
    joint_attention_dim: int = Field(2048, ge=1)
    """Width the text sequence is padded to before the context embedder: ≥ the encoders' widths side by side
    (CLIP-L 768 + bigG 1280 = 2048; SD3's 4096 is T5's width, which this project does not train with)."""
    caption_projection_dim: int = Field(1216, ge=1)
    pooled_projection_dim: int = Field(2048, ge=1)
    """The encoders' projected pooled outputs side by side (768 + 1280 = 2048)."""
    pos_embed_max_size: int = Field(96, ge=1)
    """Largest latent side in patches the positional table covers (96: 1536 px with SD's VAE)."""
    qk_norm: Literal["rms_norm", "layer_norm"] | None = "rms_norm"

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, data):
        if isinstance(data, dict) and data.get("preset") in MMDIT_PRESETS:
            return {**MMDIT_PRESETS[data["preset"]], **data}
        return data


class Denoiser(Section):
    """Which model family denoises (``model/denoisers/``); its architecture is ``models.<family>``."""

    family: Literal["unet", "mmdit", "sdxl"] = "unet"


class NoiseSchedule(Section):
    """DDPM training schedule (the reference run: scaled_linear 0.00085 → 0.012, 1000 steps)."""

    num_train_timesteps: int = 1000
    beta_start: float = 0.00085
    beta_end: float = 0.012
    beta_schedule: Literal["scaled_linear", "linear"] = "scaled_linear"
    prediction_type: Literal["epsilon", "v_prediction"] = "epsilon"
    rescale_betas_zero_snr: bool = False
    """Zero terminal SNR (Lin et al. 2023); needs v_prediction. Sampling then starts at t = T."""

    @model_validator(mode="after")
    def _zero_snr_needs_v(self) -> NoiseSchedule:
        if self.rescale_betas_zero_snr and self.prediction_type != "v_prediction":
            raise ValueError("rescale_betas_zero_snr needs prediction_type v_prediction (ε is undefined at SNR 0)")
        return self


class CaptionerBuild(Section):
    """The demo's captioner: a tiny BLIP trained in ``prepare_models`` on demo renders (``recaption.model: build``).
    sdforge/demo/captioner.py says what it learns; bench.demo_captioner measures it (3 seeds: colour 1.0, shape
    ≥ 0.99 on shown combinations, held-out shape 0.55, ~35 s on 2 cores)."""

    steps: int = Field(1000, ge=0)
    batch_size: int = Field(32, ge=1)
    lr: float = Field(2e-3, gt=0)
    width: int = Field(96, ge=16)
    layers: int = Field(2, ge=1)
    image_size: int = Field(32, ge=16)
    off_palette: float = Field(0.5, ge=0, lt=1)
    """Share of each batch drawn in colours far from every demo colour (article and colour word left out of the
    loss): without them the model guesses a held-out combination's shape from its colour and background."""


EVAL_CLIP_DIR = "eval_clip"
"""Under ``paths.models``: the scoring CLIP ``prepare_models`` saves (``models.eval_clip``)."""
FID_INCEPTION_FILE = "fid_inception.pt"
"""Under ``paths.models``: the FID Inception ``prepare_models`` copies (``models.fid_inception``)."""


class Models(Section):
    """Where the frozen VAE / text encoder come from, and the UNet architecture."""

    source: Literal["build", "pretrained"] = "build"
    vae: Url = "stabilityai/sd-vae-ft-mse"
    text_encoder: Url = "openai/clip-vit-large-patch14"
    missing_weights: Literal["error", "random"] = "error"
    """With ``source: pretrained``, what to do when the ``vae`` / ``text_encoder`` weights are neither a local
    folder nor in the local Hugging Face cache: ``error`` (a clear error naming the id), or ``random``: build
    the real architecture from ``sdforge/architectures`` with seeded random weights (``seed``) and CLIP's real
    tokenizer. For ``sdforge preflight`` only, never for a real run: random frozen models give meaningless
    latents and text embeddings."""
    eval_clip: Url | None = None
    """The CLIP that scores images (CLIP score of the eval grid and of ``sdforge evaluate --protocol coco``): a
    hub id (``openai/clip-vit-large-patch14``) or a local folder, loaded with ``from_pretrained`` by
    ``prepare_models`` and saved to ``${paths.models}/eval_clip/`` (pinned by DVC with the other frozen models);
    null: none. With ``missing_weights: random`` its real architecture is built with random weights instead."""
    fid_inception: Url | None = None
    """The FID Inception (the NVlabs TorchScript ``inception-2015-12-05.pt`` that clean-fid and StyleGAN use): a URL
    or a local file, copied by ``prepare_models`` to ``${paths.models}/fid_inception.pt``; null: none. With
    ``missing_weights: random``: a seeded stand-in with its interface (not its architecture, docs/EVAL.md)."""
    fid_inception_sha256: str | None = Field(None, pattern=r"^[0-9a-f]{64}$")
    """The file's SHA-256: a download that differs is refused (null: not checked, its hash is logged)."""
    vae_build: VaeBuild = VaeBuild()
    text_encoder_build: TextEncoderBuild = TextEncoderBuild()
    text_encoder_2: Url = "laion/CLIP-ViT-bigG-14-laion2B-39B-b160k"
    """The second text encoder of a family that has two (``mmdit``: OpenCLIP ViT-bigG/14 with projection, as SD3);
    its tokenizer must share the first's vocabulary (CLIP's BPE)."""
    text_encoder_2_build: TextEncoderBuild = TextEncoderBuild(seed=1)
    """The demo's second tiny text encoder (another draw: seed 1)."""
    denoiser: Denoiser = Denoiser()
    unet: UNetSpec = UNetSpec()
    mmdit: MMDiTSpec = MMDiTSpec()
    sdxl: SDXLSpec = SDXLSpec()
    noise: NoiseSchedule = NoiseSchedule()
    captioner_build: CaptionerBuild | None = None
    """Train the demo captioner into ``paths.models``/captioner (null: none is built)."""
    seed: int = 0

    @property
    def denoiser_spec(self) -> dict:
        """The architecture of ``denoiser.family``: the ``models.<family>`` section as a dict."""
        return getattr(self, self.denoiser.family).model_dump()

    def text_encoder_builds(self) -> list[tuple[TextEncoderBuild, int]]:
        """The demo's text encoder builds with their seeds, as many as ``text_encoders`` (1 or 2)."""
        second = self.text_encoder_2_build
        return [(self.text_encoder_build, self.text_encoder_seed),
                (second, self.seed + 1 if second.seed is None else second.seed)]  # fmt: skip

    @property
    def text_encoder_seed(self) -> int:
        """The demo text encoder's build seed: ``text_encoder_build.seed``, else ``seed``."""
        return self.seed if self.text_encoder_build.seed is None else self.text_encoder_build.seed
