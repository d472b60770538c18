"""``sources.<name>``: where a data source's metadata and images come from, how its rows are filtered and its
images fetched, its per-kind options and its optional recaptioning."""

from __future__ import annotations

import ipaddress
import string
from typing import Literal

from pydantic import Field, StrictInt, field_validator, model_validator

from sdforge.config.base import Section, Url


class Columns(Section):
    """Column names of a LAION-style metadata parquet (mirrors spell them differently)."""

    url: str = "URL"
    caption: str = "TEXT"
    width: str = "WIDTH"
    height: str = "HEIGHT"
    similarity: str = "similarity"
    punsafe: str = "punsafe"
    pwatermark: str = "pwatermark"
    aesthetic: str = "AESTHETIC_SCORE"
    hash: str = "hash"


class FilterRules(Section):
    """Quality-filter thresholds; ``None`` disables a rule."""

    min_aesthetic: float | None = None
    min_similarity: float | None = None
    min_width: int | None = Field(None, ge=0)
    min_height: int | None = Field(None, ge=0)
    max_pwatermark: float | None = Field(None, ge=0, le=1)
    max_punsafe: float | None = Field(None, ge=0, le=1)
    dedup_url: bool = True
    dedup_hash: bool = True


class FetchSettings(Section):
    """Image fetch / re-shard settings (img2dataset for URL sources)."""

    image_size: int = Field(512, ge=8)
    resize_mode: Literal["center_crop", "border", "keep_ratio", "no"] = "center_crop"
    processes: int = Field(1, ge=1)
    threads: int = Field(16, ge=1)
    timeout: float = Field(10, gt=0)
    retries: int = Field(0, ge=0)
    shard_size: int = Field(10000, ge=1)
    min_success_rate: float = Field(0.5, ge=0, le=1)
    distributor: Literal["multiprocessing", "pyspark", "ray"] = "multiprocessing"
    serve_demo: bool = False
    """Serve ``paths.demo_source`` on ``demo.http_port`` (loopback) while fetching."""
    allow_networks: list[str] = []
    """CIDRs the SSRF guard lets through although they are loopback/private/link-local/multicast/
    unspecified (the demo: ``["127.0.0.0/8"]``). Empty: only public addresses are fetched."""
    max_image_pixels: int = Field(89_478_485, ge=1)
    """Decompression-bomb limit (width × height of the *original* image); PIL's default."""
    max_caption_chars: int = Field(4096, ge=77)
    """A longer caption is cut to this many characters where it enters (filter: counted as ``captions_truncated``
    and flagged in ``filtered.parquet``'s ``caption_truncated``) and again wherever a stage reads one (fetch,
    encode, recaption), so a tokenizer never sees more (:mod:`sdforge.bounds.captions`). 77 CLIP tokens of
    English take ~300-400 characters."""
    encode_quality: int = Field(95, ge=1, le=100)
    """JPEG quality of the re-encoded 512² images (img2dataset's default)."""
    user_agent_token: str | None = None
    """Appended to img2dataset's user agent so site owners can identify the crawler."""

    @model_validator(mode="after")
    def _output_fits_the_pixel_limit(self) -> FetchSettings:
        if self.image_size**2 > self.max_image_pixels:
            raise ValueError(
                f"image_size {self.image_size} makes {self.image_size**2} output pixels, more than max_image_pixels "
                f"{self.max_image_pixels}: every image would be rejected as too_large; raise max_image_pixels"
            )
        return self

    @field_validator("allow_networks")
    @classmethod
    def _networks_parse(cls, value: list[str]) -> list[str]:
        for cidr in value:
            try:
                ipaddress.ip_network(cidr, strict=False)
            except ValueError:
                raise ValueError(f"{cidr!r} is not an IP network (e.g. '127.0.0.0/8', '::1/128')") from None
        return value


class JourneyDbOptions(Section):
    """JourneyDB: which annotation text becomes the caption."""

    caption: Literal["prompt", "caption"] = "prompt"
    """``prompt`` (the Midjourney prompt) or ``caption`` (``Task2.Caption``, a description)."""


class FaceOptions(Section):
    """VGGFace2: template captions; ``{gender}`` is filled from ``identity_meta.csv`` when present."""

    templates: list[str] = Field(
        [
            "a close-up photo of a {gender}'s face",
            "a portrait photograph of a {gender}",
            "a headshot of a {gender}, detailed face",
        ],
        min_length=1,
    )
    gender_words: dict[str, str] = {"m": "man", "f": "woman"}
    """``identity_meta.csv`` ``Gender`` value → the word ``{gender}`` becomes."""
    unknown_gender: str = "person"
    """``{gender}`` for identities missing from ``identity_meta.csv`` (or when it is absent)."""

    @field_validator("templates")
    @classmethod
    def _only_gender_placeholder(cls, templates: list[str]) -> list[str]:
        for template in templates:
            try:
                fields = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
            except ValueError as err:
                raise ValueError(f"template {template!r}: {err}") from None
            if fields - {"gender"}:
                raise ValueError(f"template {template!r}: the only placeholder is {{gender}}; got {sorted(fields)}")
        return templates


class CocoOptions(Section):
    """COCO: keep images with a tall enough person box."""

    min_person_height: float = Field(0.55, gt=0, le=1)
    """Keep an image when some non-crowd ``person`` box is at least this fraction of its height."""
    instances: str = "annotations/instances_*.json"
    captions: str = "annotations/captions_*.json"
    """Globs (relative to the source folder) of the annotation files."""


class LocalOptions(Section):
    """Local folder: ``name.<img>`` + ``name.txt`` (``mode: txt``) or ``name.json`` with ``tags``/``score``."""

    mode: Literal["txt", "json"] = "txt"
    exclude_tags: list[str] = []
    """A sample carrying any of these tags is dropped."""
    remove_tags: list[str] = []
    """Removed from the caption (the sample is kept)."""
    replace_tags: dict[str, str] = {}
    min_score: float | None = None
    """Drop samples whose score (plus bonuses) is below this; ``None`` disables."""
    tag_score_bonus: dict[str, float] = {}
    """Added to the score for each tag present, before ``min_score`` is applied."""
    shuffle_tags: float = Field(0.0, ge=0, le=1)
    """Probability that a sample's tag order is shuffled (seeded by ``seed`` and the file name)."""
    seed: int = 0


class Shorten(Section):
    """The optional second captioning pass: a text model rewrites each accepted caption shorter (the reference
    SD3 run's LLaVA → Llama). Loaded with ``AutoModelForCausalLM`` / ``AutoModelForSeq2SeqLM``."""

    model: Url
    revision: str | None = None
    prompt: str = "Rewrite this image description in at most 30 words: {caption}\nShort description:"
    """``{caption}`` is replaced by the vision model's caption."""
    generation: dict[str, StrictInt | float | bool] = {"max_new_tokens": 48, "num_beams": 1}


class Recaption(Section):
    """``sources.<s>.recaption``: the ``caption_images`` stage's captioner (docs/CAPTIONS.md).

    Any model ``AutoModelForImageTextToText`` loads (BLIP, Florence-2, LLaVA-style, Qwen-VL-style), from a hub id
    or a local folder; ``build``: the demo's captioner that ``prepare_models`` trains into ``paths.models``."""

    model: Url
    revision: str | None = None
    prompt: str = ""
    """The text the model continues (BLIP: ``a picture of``) or its instruction (LLaVA-style chat prompt)."""
    generation: dict[str, StrictInt | float | bool] = {"max_new_tokens": 40, "num_beams": 1}
    """``generate`` keyword arguments; ``do_sample`` is refused (captions must be a function of the image)."""
    batch_size: int = Field(16, ge=1)
    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    backend: Literal["transformers", "vllm"] = "transformers"
    """``vllm`` (installed apart: ``pip install vllm``, CUDA only) serves the same model for throughput."""
    max_tokens: int = Field(77, ge=1)
    """CLIP tokens a synthetic caption may have; longer ones are rejected (the text encoder would cut them)."""
    shorten: Shorten | None = None

    @field_validator("generation")
    @classmethod
    def _deterministic(cls, generation: dict) -> dict:
        if generation.get("do_sample"):
            raise ValueError("do_sample must be false: the content cache keys captions on the settings")
        return generation


class InputLimits(Section):
    """What one document of a source's data files may cost before it is parsed (:mod:`sdforge.bounds`;
    docs/INPUTS.md). A record over a limit is dropped and counted under the limit's reason; a whole file over
    one (a COCO annotation file) is an error naming the file and the key."""

    json_max_depth: int = Field(32, ge=1, le=900)
    """Nesting levels of one JSON document (DiffusionDB/COCO files, JourneyDB lines, side files, WebDataset
    ``.json`` members); the real formats nest 2–5. At most 900: the parser's own recursion limit is ~1,000."""
    json_max_bytes: int = Field(2**30, ge=1)
    """Bytes of one JSON document (COCO's ``instances_train2017.json``, the largest real one, is 448 MB)."""
    json_max_entries: int = Field(200_000_000, ge=1)
    """Values in all arrays and objects of one JSON document (COCO train2017's instances file holds tens of
    millions, mostly polygon coordinates)."""
    archive_max_bytes: int = Field(64 << 30, ge=1)
    """Bytes a compressed side file (a JourneyDB annotation ``.jsonl.tgz``) may inflate to."""
    archive_max_ratio: int = Field(100, ge=1)
    """Inflated ÷ compressed size of a side file or a DiffusionDB JSON member (JSON text gzips 5–20×; a bomb
    1,000× and more); a file inflates to at least 64 MiB whatever its ratio."""


class Source(Section):
    """One data source: where its metadata/archives come from and how to filter/fetch."""

    kind: Literal["laion", "diffusiondb", "journeydb", "vggface2", "coco", "local"]
    repo: Url
    """HF dataset repo id, or a local directory (demo, tests) holding the same files."""
    revision: str | None = None
    allow_patterns: list[str] = ["*.parquet"]
    cache_dir: str | None = None
    """Hub download cache (``snapshot_download(cache_dir=...)``); env ``HF_HUB_CACHE`` when None."""
    columns: Columns = Columns()
    filter: FilterRules = FilterRules()
    fetch: FetchSettings = FetchSettings()
    journeydb: JourneyDbOptions = JourneyDbOptions()
    vggface2: FaceOptions = FaceOptions()
    coco: CocoOptions = CocoOptions()
    local: LocalOptions = LocalOptions()
    inputs: InputLimits = InputLimits()
    recaption: Recaption | None = None
    """A vision-language model rewrites this source's captions (stage ``caption_images``); null: originals only."""
