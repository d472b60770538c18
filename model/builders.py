"""Model wiring: build the UNet, VAE, text encoder, tokenizer vocabulary and noise scheduler.

Pure torch + diffusers/transformers; no file I/O, no params files. Stages pass plain values
(``UNetSpec.model_dump()`` etc.) and do the saving/loading.

Every builder that draws random weights takes a ``seed`` and draws from a forked RNG, so the
same seed gives bit-identical weights and the caller's global RNG state is left untouched.
"""

from __future__ import annotations

import math

import torch
from diffusers import AutoencoderKL, DDPMScheduler
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

from model.denoisers.unet import (  # noqa: F401 - re-exported: the UNet's builders live with its family
    UNET_OPTIONAL_KEYS,
    UNET_SPEC_KEYS,
    build_unet,
    output_projections,
    unet_config,
    zero_init_output_projections,
)
from model.seeding import seeded

BOS_TOKEN = "<|startoftext|>"
EOS_TOKEN = "<|endoftext|>"
END_OF_WORD = "</w>"

def count_parameters(module: torch.nn.Module, trainable_only: bool = False) -> int:
    """Number of parameters (all, or only those with ``requires_grad``)."""
    return sum(p.numel() for p in module.parameters() if p.requires_grad or not trainable_only)


# ---------------------------------------------------------------------------------------------- VAE


def _group_count(channels: list[int], preferred: int = 32, min_per_group: int = 4) -> int:
    """GroupNorm groups for these widths: the largest divisor of all widths that is ≤ ``preferred``
    and leaves ≥ ``min_per_group`` channels per group (SD's VAE: 32 groups of ≥ 4 channels).

    One channel per group would be instance norm, which erases each channel's mean: the flat
    colours a VAE must carry through.
    """
    g = math.gcd(*channels)
    fits = [d for d in range(1, min(g, preferred) + 1) if g % d == 0 and g // d >= min_per_group]
    return max(fits, default=1)


def build_tiny_vae(
    block_out_channels: list[int],
    layers_per_block: int,
    latent_channels: int,
    seed: int,
    mid_block_attention: bool = False,
) -> AutoencoderKL:
    """A small random ``AutoencoderKL``; downsamples by ``2 ** (len(block_out_channels) - 1)``.

    SD's VAE has self-attention in its mid blocks; at demo size it only slows the first
    hundred steps (flat-colour reconstructions reach a given loss in fewer steps without it),
    so it is off unless ``mid_block_attention``.

    ``scaling_factor`` starts at 1.0; set it from data with
    :func:`model.vae_training.latent_scaling_factor` after training.
    """
    if not block_out_channels:
        raise ValueError("block_out_channels needs at least one entry; got []")
    n = len(block_out_channels)
    with seeded(seed):
        return AutoencoderKL(
            in_channels=3,
            out_channels=3,
            down_block_types=("DownEncoderBlock2D",) * n,
            up_block_types=("UpDecoderBlock2D",) * n,
            block_out_channels=tuple(block_out_channels),
            layers_per_block=layers_per_block,
            latent_channels=latent_channels,
            norm_num_groups=_group_count(list(block_out_channels)),
            scaling_factor=1.0,
            mid_block_add_attention=mid_block_attention,
        )


def vae_downsample_factor(vae: AutoencoderKL) -> int:
    """Pixels per latent cell along one side."""
    return 2 ** (len(vae.config.block_out_channels) - 1)


# ------------------------------------------------------------------------------ tokenizer / text


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2/CLIP's reversible byte → printable unicode character table."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs), strict=True))


def _bpe(symbols: list[str], ranks: dict[tuple[str, str], int]) -> list[str]:
    """Apply BPE merges by rank (lowest first), as CLIP's tokenizer does."""
    symbols = list(symbols)
    while len(symbols) > 1:
        pairs = zip(symbols, symbols[1:], strict=False)
        first, second = min(pairs, key=lambda pair: ranks.get(pair, math.inf))
        if (first, second) not in ranks:
            break
        merged: list[str] = []
        i = 0
        while i < len(symbols):
            if i < len(symbols) - 1 and symbols[i] == first and symbols[i + 1] == second:
                merged.append(first + second)
                i += 2
            else:
                merged.append(symbols[i])
                i += 1
        symbols = merged
    return symbols


def clip_vocab_and_merges(words: list[str]) -> tuple[dict[str, int], list[str]]:
    """A CLIP BPE vocabulary in which every word of ``words`` is one token.

    Layout as in OpenAI's CLIP: the 256 byte-level characters, their ``</w>`` forms, one entry
    per merge, then ``<|startoftext|>`` and ``<|endoftext|>``. Words are lower-cased (CLIP's
    normaliser does the same) and must be letters only (CLIP's pre-tokeniser splits on anything
    else). Merges are added word by word after the merges already present, so a later word can
    never break an earlier one into pieces (BPE applies lower-ranked merges first).
    """
    byte_chars = _bytes_to_unicode()
    vocab_list = list(byte_chars.values())
    vocab_list += [c + END_OF_WORD for c in vocab_list]
    known = set(vocab_list)
    ranks: dict[tuple[str, str], int] = {}
    for word in dict.fromkeys(w.lower() for w in words):
        if not word.isalpha():
            raise ValueError(f"vocabulary words must be letters only (CLIP splits on the rest); got {word!r}")
        chars = [byte_chars[b] for b in word.encode("utf-8")]
        initial = chars[:-1] + [chars[-1] + END_OF_WORD]
        symbols = _bpe(initial, ranks)
        while len(symbols) > 1:  # no ranked pair is left in `symbols`: join the first two
            ranks[(symbols[0], symbols[1])] = len(ranks)
            token = symbols[0] + symbols[1]
            if token not in known:
                known.add(token)
                vocab_list.append(token)
            symbols = _bpe(initial, ranks)
    vocab_list += [BOS_TOKEN, EOS_TOKEN]
    vocab = {tok: i for i, tok in enumerate(vocab_list)}
    merges = [f"{a} {b}" for (a, b), _ in sorted(ranks.items(), key=lambda kv: kv[1])]
    return vocab, merges


def build_tiny_text_encoder(
    vocab_size: int,
    hidden_size: int,
    intermediate_size: int,
    num_hidden_layers: int,
    num_attention_heads: int,
    max_position_embeddings: int,
    seed: int,
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
    with_projection: bool = False,
) -> CLIPTextModel:
    """A small random ``CLIPTextModel`` in eval mode with gradients off (it is frozen at use); with
    ``with_projection`` a ``CLIPTextModelWithProjection`` (projection width = hidden size), as SD3's encoders.

    ``bos/eos_token_id`` default to the last two ids, where :func:`clip_vocab_and_merges` puts
    them; the eos id selects the pooled output.
    """
    if hidden_size % num_attention_heads:
        raise ValueError(
            f"hidden_size ({hidden_size}) must be divisible by num_attention_heads ({num_attention_heads})"
        )
    bos = vocab_size - 2 if bos_token_id is None else bos_token_id
    eos = vocab_size - 1 if eos_token_id is None else eos_token_id
    config = CLIPTextConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        max_position_embeddings=max_position_embeddings,
        projection_dim=hidden_size,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=eos,
    )
    with seeded(seed):
        model = (CLIPTextModelWithProjection if with_projection else CLIPTextModel)(config)
    model.eval().requires_grad_(False)
    return model


# ------------------------------------------------------------------------------------- scheduler


def noise_scheduler(noise: dict) -> DDPMScheduler:
    """The DDPM training scheduler from a ``NoiseSchedule`` dict (no x0 clipping: SD latents ≈ ±4)."""
    return DDPMScheduler(
        num_train_timesteps=noise["num_train_timesteps"],
        beta_start=noise["beta_start"],
        beta_end=noise["beta_end"],
        beta_schedule=noise["beta_schedule"],
        prediction_type=noise["prediction_type"],
        rescale_betas_zero_snr=noise.get("rescale_betas_zero_snr", False),
        clip_sample=False,
    )
