"""``phases.<p>``: one training phase (its data mix and hyper-parameters), its optional adapter and caption mix."""

from __future__ import annotations

from typing import Annotated, Literal, get_args

from pydantic import Field, StrictInt, field_validator, model_validator

from sdforge.config.base import SCRATCH, Effect, SafeName, Section

AdapterTarget = Literal[
    "self_attention", "cross_attention", "feed_forward", "resnet_conv", "proj", "time_embedding", "pooled_text",
    "attention", "context_attention", "context_feed_forward", "modulation", "added_conditions",
]
ADAPTER_TARGETS = get_args(AdapterTarget)
"""Layer groups an adapter may target; their module names are each family's ``lora_groups`` (``model/denoisers/``)."""
FAMILY_ADAPTER_TARGETS = {
    "unet": ("self_attention", "cross_attention", "feed_forward", "resnet_conv", "proj", "time_embedding",
             "pooled_text"),
    "mmdit": ("attention", "context_attention", "feed_forward", "context_feed_forward", "modulation"),
    "sdxl": ("self_attention", "cross_attention", "feed_forward", "resnet_conv", "proj", "time_embedding",
             "added_conditions"),
}  # fmt: skip
"""The groups of each ``models.denoiser.family`` (a test holds them equal to the families' ``lora_groups``)."""
FAMILY_CAPTION_PARTS = {"unet": (), "mmdit": ("text_encoder", "text_encoder_2", "pooled"),
                        "sdxl": ("text_encoder", "text_encoder_2", "pooled")}  # fmt: skip
"""The conditioning parts ``phases.<p>.caption_dropout`` may name, per family (the families' ``cond_parts``)."""


class Adapter(Section):
    """Train a LoRA or DoRA (peft) on the phase's init weights instead of every UNet weight."""

    type: Literal["lora", "dora"] = "lora"
    rank: int = Field(4, ge=1)
    alpha: float | None = Field(None, gt=0)
    """LoRA scale numerator: the update is ``alpha / rank · B·A``; null: ``rank`` (scale 1)."""
    dropout: float = Field(0.0, ge=0, lt=1)
    targets: list[AdapterTarget] = ["self_attention"]
    """Layer groups in words (:data:`ADAPTER_TARGETS`); mapped to diffusers module names in :mod:`model.adapters`."""
    words: list[str] = []
    """Tokenizer words whose input-embedding row trains next to the adapter (textual inversion / pivotal tuning,
    :mod:`model.learned_words`): each must be one token. The rows go to ``adapter*/learned_embeds.safetensors``
    (a family with two text encoders trains one row in each: ``learned_embeds_2.safetensors`` too) and every
    sampler of the phase (eval grid, ``generate``, export's ``text_encoder*/``) uses them. The demo learns
    its new colour word this way (docs/ADAPTERS.md)."""
    text_encoders: list[Literal["text_encoder", "text_encoder_2"]] = []
    """Text encoders that get a LoRA of the same type, rank, alpha and dropout on their attention projections
    (``q_proj``, ``k_proj``, ``v_proj``, ``out_proj``; :mod:`model.adapters`): ``text_encoder``, and
    ``text_encoder_2`` for a family with two. The empty prompt's embedding is then recomputed with the adapted
    encoders wherever CFG needs it; ``adapter*/`` holds their layers in the same LoRA file
    (``load_lora_weights`` reads all). Needs ``merge: false`` (the encoders are not the phase's to merge into)."""
    base_precision: Literal["fp32", "bf16", "nf4", "int8"] = "fp32"
    """How the frozen denoiser's linear layers are held while the adapter trains on them: as loaded; in bf16 (linear
    and convolution weights: half the bytes, bf16's rounding as the error; plain torch); or quantised (QLoRA:
    torchao's 4-bit NF4 or 8-bit weight-only, :mod:`model.quantization`; ``pip install torchao``). A base below fp32
    needs ``merge: true`` (``unet*/`` = the dequantised base + the adapter, what the phase trained) and
    ``type: lora``."""
    merge: bool = True
    """true: ``unet/`` and ``unet_ema/`` hold base + adapter merged (what the next phase, the eval grid and
    export use); false: they hold the base unchanged and the eval grid, ``generate`` and export apply
    ``adapter_ema/`` (``adapter/``) on top; the next phase then continues from the base."""

    @field_validator("targets")
    @classmethod
    def _targets_distinct(cls, targets: list[str]) -> list[str]:
        if not targets or len(set(targets)) != len(targets):
            raise ValueError(f"targets must name each layer group once, at least one of {ADAPTER_TARGETS}")
        return targets

    @field_validator("words")
    @classmethod
    def _words_distinct(cls, words: list[str]) -> list[str]:
        if len(set(words)) != len(words) or any(not w.strip() or " " in w for w in words):
            raise ValueError("words must be distinct single words")
        return words

    @model_validator(mode="after")
    def _text_encoder_lora_unmerged(self) -> Adapter:
        if len(set(self.text_encoders)) != len(self.text_encoders):
            raise ValueError(f"text_encoders must name each encoder once; got {self.text_encoders}")
        if self.text_encoders and self.merge:
            raise ValueError("text_encoders: a LoRA on the text encoders needs merge: false (the shared text "
                             "encoders are not merged into; sampling and export apply the LoRA file)")  # fmt: skip
        if self.base_precision != "fp32" and (not self.merge or self.type != "lora"):
            raise ValueError(f"base_precision {self.base_precision}: a base below fp32 needs merge: true (its "
                             "samplers read the dequantised base + the adapter) and type: lora")  # fmt: skip
        return self


class Distill(Section):
    """``phases.<p>.distill``: latent consistency distillation (LCM-LoRA, Luo et al. 2023) of the phase's init
    weights into its adapter, so that ``sampling_steps`` sampler steps draw what the teacher draws in many.

    The teacher is the ``init_from`` weights, frozen (the UNet with its adapter switched off); the student is the
    same UNet with the adapter on. Each sample's target is the student's consistency value (stop-gradient) at the
    point the teacher's DDIM step reaches from the sample's noisy latents, one grid step of
    ``num_ddim_timesteps`` lower, with the classifier-free guidance ``w`` drawn per sample (docs/ADAPTERS.md
    "Distillation")."""

    method: Literal["lcm"] = "lcm"
    num_ddim_timesteps: int = Field(50, ge=2)
    """Points of the teacher's solver grid (the LCM paper's skip: ``num_train_timesteps / num_ddim_timesteps``)."""
    w_min: float = Field(3.0, ge=1)
    w_max: float = Field(15.0, ge=1)
    """The teacher's guidance scale, drawn uniformly in ``[w_min, w_max]`` per sample, in this project's (and
    diffusers' pipeline) convention ``out = uncond + w·(cond − uncond)``: the paper's ω ∈ [2, 14] is w ∈ [3, 15]."""
    loss: Literal["l2", "huber"] = "huber"
    huber_c: float = Field(0.001, gt=0)
    """Pseudo-Huber ``sqrt(d² + c²) − c`` per element (``loss: huber``; LCM-LoRA's 0.001)."""
    timestep_scaling: float = Field(10.0, gt=0)
    """LCM's boundary-condition scalings ``c_skip``/``c_out`` at ``timestep × timestep_scaling`` (diffusion phases;
    diffusers' ``LCMScheduler`` uses the same value at sampling). A flow-matching student's consistency value is
    ``x − σ·v``, which meets the boundary by construction."""
    sampling_steps: int = Field(4, ge=1)
    """Steps the eval grid samples the distilled phase with, and ``sdforge generate``'s default for it
    (guidance 1: the guidance is in the teacher's solve)."""

    @model_validator(mode="after")
    def _w_range(self) -> Distill:
        if self.w_max < self.w_min:
            raise ValueError(f"w_max ({self.w_max}) must be >= w_min ({self.w_min})")
        return self


class ControlNet(Section):
    """``phases.<p>.controlnet``: train a ControlNet (Zhang et al. 2023) on the phase's init UNet, frozen, so that
    a conditioning image (``condition``, made by ``condition_images`` beside each latent) steers where things are
    drawn. Built with diffusers' ``ControlNetModel.from_unet`` from the ``init_from`` weights (their encoder copied,
    its output convolutions zero: the untrained ControlNet changes nothing). A ControlNet phase's ``cfg_dropout``
    defaults to the paper's 0.5 (half the samples train on the empty prompt, so the condition alone must carry the
    layout). docs/CONTROL.md."""

    condition: Literal["canny"] = "canny"
    """The conditioning image's kind; it must be in ``conditions.kinds`` (``condition_images`` makes it)."""
    conditioning_scale: float = Field(1.0, gt=0)
    """The ControlNet's residuals are multiplied by this before they enter the UNet, in training and sampling
    (diffusers' ``controlnet_conditioning_scale``)."""
    embedding_channels: list[Annotated[int, Field(ge=1)]] | None = None
    """Widths of the conditioning image's encoder, one more than the VAE's stride-2 stages; null: diffusers'
    ``[16, 32, 96, 256]`` for an 8× VAE (its first entries for a smaller one)."""


CONTROLNET_CFG_DROPOUT = 0.5
"""A ControlNet phase's ``cfg_dropout`` unless it sets one: the paper replaces half the prompts by the empty one."""


class CaptionMix(Section):
    """``phases.<p>.caption_mix``: the share of samples that train with their original and with their synthetic
    caption (``caption_images``), chosen per (seed, sample, epoch) (:mod:`sdforge.captions.mix`)."""

    original: float = Field(ge=0, le=1)
    synthetic: float = Field(ge=0, le=1)

    @model_validator(mode="after")
    def _sums_to_one(self) -> CaptionMix:
        if abs(self.original + self.synthetic - 1.0) > 1e-6:
            raise ValueError(f"original + synthetic must be 1; got {self.original} + {self.synthetic}")
        return self


class Phase(Section):
    """One training phase: its data mix and hyper-parameters. Every key is :attr:`Effect.WEIGHTS` (it changes the
    trained weights) but ``description`` (:func:`sdforge.config.keys_by_effect`)."""

    description: Annotated[str, Effect.NONE] = ""
    """Free text: the heading of the phase's MLflow description (``mix_phase``); a run resumes across a change."""
    eval_grid: Annotated[bool, Effect.NONE] = True
    """Sample the phase's eval grid. False: its ``eval_grid`` stage still runs (the DAG and the flows keep one per
    phase) but only records that it was not sampled: the demo samples phases 0, 7 and the adapter (phases 1-6 look
    like phase 7) and saves the sampling on the others (issue 40)."""
    posthoc_ema: bool = True
    """With ``train.posthoc_sigma_rels`` set: this phase tracks the power-function EMAs, and its exported
    ``unet_ema/`` is the candidate the validation loss picks (docs/EVAL.md). False: the fixed-decay EMA only (the
    demo chooses post-hoc in phases 1 and 7, the long one and the sampled one, and saves the rebuilds elsewhere)."""
    init_from: SafeName = SCRATCH
    init_weights: Literal["ema", "live"] = "ema"
    init_path: str | None = None
    """Optional foreign weights to start from instead (a ``.safetensors``/``.pt`` state dict, e.g. the
    reference run's checkpoint); wrapper prefixes (``module.``, ``_orig_mod.``, ``unet.``,
    ``_fsdp_wrapped_module.``) are stripped and the keys must match ``models.unet``."""
    mix: dict[SafeName, StrictInt | float]
    """source name → fraction of the phase's samples (decimals summing to 1, e.g. ``0.6``) or a sample
    count (integers, e.g. ``150000``; then ``samples`` must equal their sum). One mix uses one kind."""
    samples: int = Field(ge=1)
    """Samples in the phase's index (one epoch)."""
    with_replacement: bool = False
    epochs: int = Field(1, ge=1)
    lr: float = Field(gt=0)
    warmup_steps: int = Field(0, ge=0)
    cfg_dropout: float = Field(0.1, ge=0, lt=1)
    caption_dropout: dict[str, Annotated[float, Field(ge=0, lt=1)]] = {}
    """Per conditioning part, the probability it alone is replaced by the empty prompt's (drawn per sample, after
    ``cfg_dropout``'s whole-prompt drop). The mmdit family's parts: ``text_encoder``, ``text_encoder_2`` (each
    encoder's sequence) and ``pooled`` (the second public MM-DiT run: 0.316 each sequence, so both 10 %, and 0.1
    pooled). {}: none. The unet family has none to name."""
    min_snr_gamma: float | None = Field(5.0, gt=0)
    batch_size: int = Field(24, ge=1)
    grad_accum: int = Field(1, ge=1)
    resolution: SafeName | None = None
    """The bucket set (a name under ``buckets``) the phase trains on; None: the only one defined."""
    objective: Literal["diffusion", "flow_matching"] | None = None
    """diffusion: noise prediction with ``models.noise`` (ε or v, DDIM sampling); flow_matching: rectified
    flow (velocity ``ε − x0`` on ``x_σ = (1−σ)·x0 + σ·ε``, Euler sampling). null: ``train.objective``.
    docs/OBJECTIVES.md says what changes when a phase switches objective from its init."""
    timestep_sampling: Literal["uniform", "logit_normal"] = "uniform"
    """How training timesteps (diffusion) or σ (flow matching) are drawn: uniform (SD 1.x), or
    ``sigmoid(mean + std·z)`` (SD3) with ``logit_normal``'s ``[mean, std]``."""
    logit_normal: tuple[float, Annotated[float, Field(gt=0)]] = (0.0, 1.0)
    """``[mean, std]`` of ``timestep_sampling: logit_normal``; mean > 0 favours high noise."""
    flow_shift: Annotated[float, Field(gt=0)] | Literal["resolution"] = 1.0
    """Flow matching: σ ↦ shift·σ / (1 + (shift − 1)·σ) in training and sampling (SD3: 3.0 at 1024²). ``resolution``:
    SD3's resolution-dependent shift ``√(m / 256²)`` for the phase's bucket set, ``m`` its largest bucket's pixel
    count (1 at 256², 2 at 512², 4 at 1024²); resolved when the params load, so the run dir, ``state.json`` and the
    export record the number."""
    noise_offset: float = Field(0.0, ge=0)
    """Per-sample, per-channel constant added to the noise, times this (diffusers ``--noise_offset``; 0: off)."""
    input_perturbation: float = Field(0.0, ge=0)
    """The model's input is noised with ``noise + γ·ξ`` while the target keeps ``noise`` (Ning et al. 2023;
    diffusers ``--input_perturbation``; 0: off)."""
    optimizer: Literal["adamw", "adamw8bit", "prodigy"] = "adamw"
    """adamw (torch; fused on CUDA); adamw8bit (bitsandbytes, 8-bit states; installed apart:
    ``pip install bitsandbytes``); prodigy (``prodigyopt``: the LR is found by D-adaptation, so ``lr`` is
    a multiplier, usually 1.0)."""
    adapter: Adapter | None = None
    """Train a LoRA/DoRA on the init weights instead of the whole UNet (null: a full fine-tune)."""
    distill: Distill | None = None
    """Train the adapter by latent consistency distillation of the init weights (a few-step sampler) instead of the
    denoising objective; needs ``adapter`` (the student is the init UNet plus it). null: an ordinary phase."""
    controlnet: ControlNet | None = None
    """Train a ControlNet on the frozen init UNet instead of the UNet itself (null: an ordinary phase); its
    ``cfg_dropout`` defaults to 0.5."""
    caption_mix: CaptionMix | None = None
    """null: original captions only. A sample without a synthetic caption (its source not recaptioned, or its
    caption rejected) trains with its original one whatever the draw."""

    @property
    def synthetic_share(self) -> float:
        """The probability that a sample with a synthetic caption trains with it in an epoch."""
        return self.caption_mix.synthetic if self.caption_mix else 0.0

    @property
    def mix_is_counts(self) -> bool:
        """True when ``mix`` gives sample counts rather than fractions."""
        return all(isinstance(v, int) for v in self.mix.values())

    @field_validator("mix")
    @classmethod
    def _fractions_or_counts(cls, mix: dict[str, int | float]) -> dict[str, int | float]:
        if not mix:
            raise ValueError("a phase needs at least one source in its mix")
        kinds = {isinstance(v, int) for v in mix.values()}
        if len(kinds) > 1:
            raise ValueError(
                f"mix values must be all fractions (decimals such as 0.6) or all sample counts "
                f"(integers such as 150000), not both; got {mix}"
            )
        if kinds == {True}:
            if any(n < 1 for n in mix.values()):
                raise ValueError(f"mix counts must be >= 1; got {mix}")
            return mix
        if any(f <= 0 for f in mix.values()):
            raise ValueError(f"mix fractions must be > 0; got {mix}")
        total = sum(mix.values())
        if abs(total - 1.0) > 1e-6:
            raise ValueError(f"mix fractions must sum to 1; they sum to {total:.6g}: {mix}")
        return mix

    @model_validator(mode="after")
    def _distill_options(self) -> Phase:
        if self.distill is None:
            return self
        if self.adapter is None:
            raise ValueError("distill needs an adapter: the student is the init UNet plus a LoRA (adapter: {...})")
        if self.init_from == SCRATCH and self.init_path is None:
            raise ValueError("distill needs a teacher: set init_from to a trained phase")
        unused = {
            "cfg_dropout": self.cfg_dropout, "min_snr_gamma": self.min_snr_gamma, "noise_offset": self.noise_offset,
            "input_perturbation": self.input_perturbation,
        }  # fmt: skip
        set_keys = sorted(k for k, v in unused.items() if v)
        if set_keys or self.timestep_sampling != "uniform" or self.adapter.words:
            raise ValueError(
                f"a distill phase draws its own timesteps and guidance: set {', '.join(set_keys) or '-'} to 0/null, "
                f"timestep_sampling to uniform (is {self.timestep_sampling}) and adapter.words to [] "
                "(docs/ADAPTERS.md \"Distillation\")"
            )
        return self

    @model_validator(mode="after")
    def _controlnet_options(self) -> Phase:
        if self.controlnet is None:
            return self
        others = [key for key, value in (("adapter", self.adapter), ("distill", self.distill)) if value is not None]
        if others:
            raise ValueError(f"controlnet trains a ControlNet on the frozen init UNet; it does not combine with "
                             f"{' or '.join(others)} — remove {'them' if len(others) > 1 else 'it'}")  # fmt: skip
        if self.init_from == SCRATCH and self.init_path is None:
            raise ValueError("controlnet needs a trained UNet to copy and steer: set init_from to a trained phase")
        if "cfg_dropout" not in self.model_fields_set:
            object.__setattr__(self, "cfg_dropout", CONTROLNET_CFG_DROPOUT)  # frozen: the default depends on the kind
        return self

    @model_validator(mode="after")
    def _counts_match_samples(self) -> Phase:
        if self.mix_is_counts and sum(self.mix.values()) != self.samples:
            raise ValueError(
                f"mix: the counts sum to {sum(self.mix.values())} but samples is {self.samples}; make them "
                f"agree (fractions are written with a decimal point, e.g. 1.0): {self.mix}"
            )
        return self
