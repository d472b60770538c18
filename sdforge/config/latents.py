"""``buckets`` and ``encode``: the aspect-ratio bucket sets (training resolutions) and the VAE latent encoding of
the fetched shards at each of them."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from sdforge.config.base import SafeName, Section


class BucketSet(Section):
    """One training resolution's aspect-ratio buckets (:mod:`sdforge.ingest.buckets`): ``sizes`` listed, or
    generated from ``max_area`` (the target's area, e.g. 512² = 262144), ``step`` and the aspect range."""

    sizes: list[tuple[Annotated[int, Field(ge=1)], Annotated[int, Field(ge=1)]]] | None = None
    """(width, height) pairs in pixels, e.g. ``[[512, 512]]`` for square-only."""
    max_area: int | None = Field(None, ge=1)
    step: int = Field(64, ge=1)
    """Sides are multiples of this (64 px = 8 latent pixels with SD's VAE; must suit the UNet's downsampling)."""
    min_aspect: float = Field(0.5, gt=0, le=1)
    max_aspect: float = Field(2.0, ge=1)

    @model_validator(mode="after")
    def _listed_or_generated(self) -> BucketSet:
        if (self.sizes is None) == (self.max_area is None):
            raise ValueError("give either sizes (a list of [width, height]) or max_area, not both or neither")
        if self.sizes is not None:
            if not self.sizes:
                raise ValueError("sizes is empty")
            odd = [s for s in self.sizes if s[0] % self.step or s[1] % self.step]
            if odd:
                raise ValueError(f"sizes {odd} are not multiples of step {self.step}")
        elif self.max_area < self.step * self.step:
            raise ValueError(f"max_area {self.max_area} holds no {self.step}×{self.step} bucket")
        return self


class Encode(Section):
    """VAE latent encoding of fetched shards: per bucket set (resolution), latent shards per input tar and bucket."""

    batch_size: int = Field(16, ge=1)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    resolution: int = Field(512, ge=8)
    """Side of the square-only bucket set used when ``params.buckets`` is empty (older configs)."""
    resolutions: list[SafeName] = []
    """Bucket sets (names under ``buckets``) every source is encoded at; empty: all of them."""
    wrong_size: Literal["resize", "skip"] = "resize"
    """An image whose size is not its bucket's is resized to cover the bucket and centre-cropped, or skipped."""
    decode_workers: int = Field(4, ge=1)
    """Threads decoding and resizing JPEGs (OpenCV releases the GIL)."""
    prefetch_shards: int = Field(2, ge=0)
    """Input tars read ahead of the one being decoded (downloaded ahead when the input is s3://)."""
    mixed_precision: Literal["no", "bf16", "fp16"] = "bf16"
    """The VAE encoder's precision: ``bf16`` autocast on CUDA, and on a CPU with native bf16 (AVX512-BF16/AMX), fp32
    elsewhere; ``fp16`` autocast everywhere (a card without bf16), for a VAE that does not overflow it — SDXL's does
    (NaN latents, refused by name): use ``madebyollin/sdxl-vae-fp16-fix`` (docs/SDXL.md); ``no``: fp32."""
    channels_last: bool = True
    """channels_last VAE and inputs on CUDA."""
    compile: bool = False
    """``torch.compile`` the VAE encoder (CUDA; batches are padded to ``batch_size``: one graph)."""
