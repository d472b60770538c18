"""Typed, validated configuration for every stage, loaded from ``params.yaml``.

One loader (:func:`load_params`) for the whole project. Every section is a frozen
pydantic model with ``extra="forbid"``: an unknown key, a wrong type or an impossible
value fails at load time with the key path and what was expected, e.g.::

    params.yaml: phases.phase3.mix.laoin: phase mixes a source that is not defined
    under 'sources' (defined: diffusiondb, laion)

Stage modules take only their own section(s); they never see the raw dict.
"""

from __future__ import annotations

import ipaddress
import logging
import re
import string
from pathlib import Path
from typing import Annotated, Literal, get_args

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    ValidationError,
    field_validator,
    model_validator,
)

log = logging.getLogger(__name__)

SCRATCH = "scratch"
"""``init_from`` value of a phase that starts from the seeded random UNet."""


class ConfigError(ValueError):
    """A params file that does not validate; the message names the key path."""


# --- names that become path components ---------------------------------------------------------------------------

_SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
MAX_NAME_LENGTH = 128
RESERVED_PHASE_NAMES = frozenset({SCRATCH})
"""``paths.checkpoints/scratch`` is the seeded initial UNet: a phase of that name would overwrite it."""


def check_safe_name(name: str) -> str:
    """Return ``name`` if it is safe as one path component (a file or folder name, a DVC stage item, an
    MLflow run name): letters, digits, ``_``, ``.``, ``-``, starting with a letter or digit, no ``..``."""
    if not _SAFE_NAME.fullmatch(name) or ".." in name or len(name) > MAX_NAME_LENGTH:
        raise ValueError(
            "not a safe name: it becomes a folder or file name, so use letters, digits, '_', '.' and '-' only, "
            f"starting with a letter or digit, without '..', at most {MAX_NAME_LENGTH} characters; got {name!r}"
        )
    return name


def check_phase_name(name: str) -> str:
    """A safe name (:func:`check_safe_name`) that is not reserved for a pipeline folder (``scratch``)."""
    check_safe_name(name)
    if name in RESERVED_PHASE_NAMES:
        raise ValueError(
            f"{name!r} is reserved (paths.checkpoints/{name} is the seeded initial UNet); rename the phase"
        )
    return name


SafeName = Annotated[str, AfterValidator(check_safe_name)]
"""A config key or value that becomes a path component: source, phase, eval category, DVC remote name."""
PhaseName = Annotated[str, AfterValidator(check_phase_name)]


# --- URL-valued params never carry credentials ------------------------------------------------------------------

_HOST_PORT = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]*)(:[0-9]{1,5})?")
_S3_BUCKET = re.compile(r"[A-Za-z0-9_.-]*")
_USERINFO = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://)[^\s'\",@]*@")
_BARE_USERINFO = re.compile(r"(?<![\w:/.+-])[^\s'\",@:/]+:(?!//)[^\s'\",@]+@(?=[A-Za-z0-9\[])")
CREDENTIALS_HINT = (
    "must not carry credentials (user:secret@host): write the URL without them and give them through the "
    "environment (S3: the AWS chain, AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or ~/.aws or the pod's role; "
    "MLflow: MLFLOW_TRACKING_USERNAME/MLFLOW_TRACKING_PASSWORD; the Hub: HF_TOKEN)"
)


def url_has_credentials(value: str) -> bool:
    """True when ``value`` may embed credentials: userinfo (``scheme://user:secret@host``, also with a ``/``
    in the secret), or ``user:secret@host`` without a scheme. Conservative: an s3 bucket or http(s) host
    that is not a plain ``name`` / ``host[:port]`` counts too."""
    scheme, sep, rest = value.partition("://")
    if not sep:
        return "@" in value.split("/", 1)[0]
    authority = re.split(r"[/?#]", rest, maxsplit=1)[0]
    if "@" in authority:
        return True
    if scheme.lower() == "s3":
        return not _S3_BUCKET.fullmatch(authority)
    if scheme.lower() in ("http", "https"):
        return not _HOST_PORT.fullmatch(authority)
    return False


def redact_credentials(text: str) -> str:
    """``text`` with the userinfo of every ``scheme://user:secret@`` (or bare ``user:secret@host``) in it
    replaced by ``***``; over-redacts an ``@`` in a URL's path rather than miss a secret holding a ``/``."""
    return _BARE_USERINFO.sub("***@", _USERINFO.sub(r"\1***@", text))


def check_no_credentials(value: str | None) -> str | None:
    """Return ``value`` (a URL, hub id or path) unless it embeds credentials (:func:`url_has_credentials`)."""
    if value is not None and url_has_credentials(value):
        raise ValueError(CREDENTIALS_HINT)
    return value


def check_s3_url(value: str | None) -> str | None:
    """Return ``value`` if it is ``s3://bucket[/prefix]`` without credentials (``None`` passes)."""
    check_no_credentials(value)
    if value is not None and (not value.startswith("s3://") or len(value) <= 5):
        raise ValueError(f"expected an s3://bucket/prefix URL; got {value!r}")
    return value


Url = Annotated[str, AfterValidator(check_no_credentials)]
"""A URL (or a hub id / local path that could be one) that must not embed credentials."""
S3Url = Annotated[str, AfterValidator(check_s3_url)]


class Section(BaseModel):
    """Base of every config section: immutable, unknown keys rejected. A rejected value is left out of
    pydantic's own message (it may be a credential); :func:`parse_params` shows the safe ones."""

    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)


RGB = tuple[int, int, int]


class Paths(Section):
    """Every on-disk location of the pipeline (relative to the repo root)."""

    demo_source: str
    metadata: str
    filtered: str
    shards: str
    captions: str
    latents: str
    models: str
    mixes: str
    checkpoints: str
    runs: str
    eval: str
    metrics: str


class Tracking(Section):
    """MLflow: tracking URI (overridden by ``MLFLOW_TRACKING_URI``) and experiment."""

    enabled: bool = True
    """``false``: stages log nothing to MLflow (their metrics JSON and logs are unchanged); for machines
    without MLflow, such as a bare GPU pod running ``bench/gpu/run.sh``, and throwaway smoke runs."""
    mlflow_uri: Url = "sqlite:///mlflow.db"
    experiment: str = "sdforge"
    ui_url: Url = "http://127.0.0.1:5000"
    """Where a user opens the MLflow UI when ``mlflow_uri`` is not a server (``make mlflow-ui`` serves the
    SQLite store there): the base of the run links in Prefect artifacts and ``tools.results``. With an
    ``http(s)`` tracking URI the links use that URI instead."""


class Storage(Section):
    """S3 (or S3-compatible) storage shared by every machine. URLs only: credentials come from the
    standard AWS chain (environment, ~/.aws, the pod's role) and are never written to params or repo.
    Checkpoints go to ``train.checkpoint_s3`` (a param of the train stage)."""

    dvc_remote: S3Url | None = None
    """``s3://bucket/prefix``: the default DVC remote (set in ``.dvc/config.local`` by the flows)."""
    remote_name: SafeName = "storage"
    """The DVC remote's name (a section of ``.dvc/config.local``)."""
    endpoint_url: Url | None = None
    """An S3-compatible endpoint (MinIO, moto, R2) for DVC; boto3 (checkpoints) reads ``AWS_ENDPOINT_URL``."""
    mlflow_artifacts: S3Url | None = None
    """``s3://bucket/prefix``: ``--artifacts-destination`` of the MLflow server ``tools.stack up --mlflow`` starts."""


class DemoConcept(Section):
    """A colour word that only a small extra demo source shows (``<demo_source>/concept/``): what the demo's
    adapter phase teaches a model that has never seen it."""

    colour: str
    rgb: RGB
    images: int = Field(96, ge=1)
    """Images in the concept source: its colour on every shape and background, in turn, on ``canvases``."""


class DemoWebdump(Section):
    """A demo source whose captions are useless — camera file names — so only recaptioning makes it trainable
    (``<demo_source>/webdump/``; ``make demo-recaption``)."""

    images: int = Field(192, ge=1)
    """Images of shown colour/shape/background combinations (never a held-out one nor the concept colour)."""


class DemoData(Section):
    """The synthetic captioned corpus: coloured shapes on plain backgrounds."""

    enabled: bool = True
    seed: int = 0
    image_size: int = Field(48, ge=16)
    half_size: tuple[Annotated[float, Field(gt=0, le=0.45)], Annotated[float, Field(gt=0, le=0.45)]] = (0.22, 0.32)
    """Range of a shape's half-width, as a fraction of the canvas's shorter side (``image_size`` for a square
    one); its centre jitters anywhere the shape fits on the canvas."""
    canvases: list[tuple[Annotated[int, Field(ge=16)], Annotated[int, Field(ge=16)]]] = []
    """(width, height) canvases the corpus images are drawn on, in turn: the ``i``-th image a source draws
    (LAION rows in drawing order: served, missing, the bad kinds; archive images in order) is on
    ``canvases[i % len(canvases)]``. Empty: one square ``image_size`` canvas (every image square)."""
    laion_rows: int = Field(0, ge=0)
    archive_images: int = Field(0, ge=0)
    http_port: int = Field(8765, ge=1024, le=65535)
    colours: dict[str, RGB]
    shapes: list[Literal["circle", "square", "triangle"]]
    backgrounds: dict[str, RGB]
    # rows the quality filter must drop / the fetch must survive, each a count
    low_aesthetic_rows: int = Field(0, ge=0)
    watermark_rows: int = Field(0, ge=0)
    nsfw_rows: int = Field(0, ge=0)
    small_rows: int = Field(0, ge=0)
    duplicate_rows: int = Field(0, ge=0)
    missing_rows: int = Field(0, ge=0)
    held_out: list[tuple[str, str, str]] = []
    """(colour, shape, background) combinations the corpus never shows (nor the VAE's training renders):
    eval prompts that ask for them measure whether the model composes words it saw only apart."""
    concept: DemoConcept | None = None
    """A new colour word for the adapter phase; the LAION and DiffusionDB parts never show it (nor the VAE)."""
    webdump: DemoWebdump | None = None
    """A source captioned with file names (recaptioned by the demo captioner); null: none."""

    @model_validator(mode="after")
    def _concept_is_new(self) -> DemoData:
        if self.concept is not None and self.concept.colour in self.colours:
            raise ValueError(f"concept.colour {self.concept.colour!r} is already a demo colour: it would not be new")
        return self

    @model_validator(mode="after")
    def _names_disjoint(self) -> DemoData:
        if self.enabled and (not self.colours or not self.shapes or not self.backgrounds):
            raise ValueError("demo needs at least one colour, shape and background")
        return self

    @model_validator(mode="after")
    def _held_out_leaves_every_word(self) -> DemoData:
        for i, (colour, shape, background) in enumerate(self.held_out):
            for name, known in ((colour, self.colours), (shape, self.shapes), (background, self.backgrounds)):
                if name not in known:
                    raise ValueError(f"held_out[{i}]: {name!r} is not a demo colour, shape or background")
        hidden = set(self.held_out)
        every = [(c, s, b) for c in self.colours for s in self.shapes for b in self.backgrounds]
        shown = [combo for combo in every if combo not in hidden]
        for axis, names in enumerate((self.colours, self.shapes, self.backgrounds)):
            lost = sorted(set(names) - {combo[axis] for combo in shown})
            if lost:
                raise ValueError(f"held_out hides every combination with {lost}: the model could never learn the word")
        return self

    @model_validator(mode="after")
    def _shapes_fit_every_canvas(self) -> DemoData:
        for width, height in self.canvas_sizes if self.enabled else []:
            half = int(min(width, height) * self.half_size[1])
            if min(width, height) - 2 * half - 4 < 1:
                raise ValueError(
                    f"canvas {width}x{height} (demo.canvases, else demo.image_size) is too small for half_size "
                    f"{self.half_size[1]}: a {2 * half}-px shape and 2-px margins leave its centre no room"
                )
        return self

    def is_held_out(self, colour: str, shape: str, background: str) -> bool:
        """Whether the corpus never shows this combination."""
        return (colour, shape, background) in set(self.held_out)

    def is_concept(self, colour: str) -> bool:
        """Whether ``colour`` is the concept colour (only the concept source shows it)."""
        return self.concept is not None and colour == self.concept.colour

    @property
    def palette(self) -> dict[str, RGB]:
        """Every colour the demo draws and the probe reads: ``colours`` plus the concept's."""
        extra = {self.concept.colour: self.concept.rgb} if self.concept else {}
        return {**self.colours, **extra}

    @property
    def canvas_sizes(self) -> list[tuple[int, int]]:
        """``canvases``, or ``[(image_size, image_size)]`` when empty."""
        return [tuple(c) for c in self.canvases] or [(self.image_size, self.image_size)]


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
    recaption: Recaption | None = None
    """A vision-language model rewrites this source's captions (stage ``caption_images``); null: originals only."""


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


class UNetSpec(Section):
    """The keys of ``UNet2DConditionModel``'s config that this project sets."""

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
    vae_build: VaeBuild = VaeBuild()
    text_encoder_build: TextEncoderBuild = TextEncoderBuild()
    unet: UNetSpec = UNetSpec()
    noise: NoiseSchedule = NoiseSchedule()
    captioner_build: CaptionerBuild | None = None
    """Train the demo captioner into ``paths.models``/captioner (null: none is built)."""
    seed: int = 0


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
    mixed_precision: Literal["no", "bf16"] = "bf16"
    """bf16 autocast on CUDA, and on a CPU with native bf16 (AVX512-BF16/AMX); fp32 elsewhere."""
    channels_last: bool = True
    """channels_last VAE and inputs on CUDA."""
    compile: bool = False
    """``torch.compile`` the VAE encoder (CUDA; batches are padded to ``batch_size``: one graph)."""


class Train(Section):
    """Optimisation settings shared by every phase."""

    seed: int = 0
    bucket_tail: Literal["drop", "carry"] = "drop"
    """With several aspect buckets: a bucket's samples left over after its last full global batch are
    dropped for the epoch, or carried to the front of that bucket in the next epoch."""
    adam_betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = Field(1e-8, gt=0)
    weight_decay: float = Field(1e-2, ge=0)
    grad_clip: float = Field(1.0, gt=0)
    objective: Literal["diffusion", "flow_matching"] = "diffusion"
    """The default of ``phases.<p>.objective`` (one key switches every phase that does not set its own)."""
    ema_decay: float = Field(0.9999, gt=0, lt=1)
    save_steps: int = Field(0, ge=0)
    """Mid-epoch checkpoint every N optimizer steps (0: epoch ends only)."""
    keep_last: int = Field(2, ge=1)
    """Retention: the newest K checkpoints of a phase's run are kept ..."""
    keep_every: int = Field(0, ge=0)
    """... plus every checkpoint whose step is a multiple of N (0: none) ..."""
    keep_best: bool = True
    """... plus the one with the lowest mean training loss since the previous checkpoint."""
    checkpoint_s3: S3Url | None = None
    """``s3://bucket/prefix``: every checkpoint is uploaded there as it is written, and a fresh pod
    resumes from the newest of local disk and S3 (endpoint from ``AWS_ENDPOINT_URL`` if set)."""
    log_every: int = Field(10, ge=1)
    validation_every: int = Field(0, ge=0)
    """Every N optimizer steps (0: never) sample the first ``validation_prompts`` eval prompts with the
    EMA weights and log a captioned grid to MLflow as ``validation/step-NNNNNNNN.png``."""
    validation_prompts: int = Field(4, ge=1)
    progress_bar: bool = True
    """tqdm bar with ETA on the main rank."""
    nproc_per_node: int = Field(1, ge=1)
    """Processes (GPUs) per node; > 1 (or nnodes > 1) makes the stage launch ``torchrun``."""
    nnodes: int = Field(1, ge=1)
    node_rank: int = Field(0, ge=0)
    rdzv_endpoint: Url | None = None
    """``host:port`` of the rendezvous (required when nnodes > 1)."""
    mixed_precision: Literal["no", "bf16"] = "bf16"
    """bf16 autocast on CUDA, and on a CPU with native bf16 (AVX512-BF16/AMX); fp32 elsewhere."""
    tf32: bool = True
    """Allow TF32 matmuls/convolutions on CUDA."""
    text_encoder_dtype: Literal["fp32", "bf16"] = "bf16"
    """The frozen text encoder's dtype on CUDA (CPU: fp32)."""
    ema_device: Literal["model", "cpu"] = "model"
    """Where the EMA weights live: with the model (GPU), or on CPU to save GPU memory."""
    ema_update_every: int = Field(1, ge=1)
    """Update the EMA every N optimizer steps (with decay adjusted for the N steps)."""
    gradient_checkpointing: bool = False
    channels_last: bool = False
    preempt_grace_s: float = Field(25.0, gt=0)
    """On SIGTERM (a Kubernetes pod deletion, a spot/preemptible notice) the ranks stop at the next step
    boundary and write a checkpoint if it fits in this many seconds from the signal (estimated from the
    measured write time); otherwise they keep the last good one. Set it a few seconds under the pod's
    ``terminationGracePeriodSeconds`` (30 by default). docs/RESILIENCE.md."""
    hang_timeout_s: float | None = Field(None, gt=0)
    """A rank whose step (or collective) makes no progress for this long dumps every thread's stack into the
    stage log, names the lagging rank(s) and exits non-zero (the orchestrator retries from the last
    checkpoint). null: 20 × the slowest step so far, at least 300 s; checkpoints and validation get 10 × it."""
    deterministic: bool = False
    """``torch.use_deterministic_algorithms`` (warn-only: ops without a deterministic kernel warn, not fail),
    cuDNN autotuning off and ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` unless set: on CUDA a killed and resumed run
    then repeats the uninterrupted one bit for bit where every kernel allows. Slower; CPU is deterministic anyway."""

    @model_validator(mode="after")
    def _node_rank_in_range(self) -> Train:
        if self.node_rank >= self.nnodes:
            raise ValueError(f"train.node_rank {self.node_rank} must be < train.nnodes {self.nnodes}")
        return self


AdapterTarget = Literal[
    "self_attention", "cross_attention", "feed_forward", "resnet_conv", "proj", "time_embedding", "pooled_text"
]
ADAPTER_TARGETS = get_args(AdapterTarget)
"""Layer groups an adapter may target; their diffusers module names are in :mod:`model.adapters` (``UNET_GROUPS``)."""


class Adapter(Section):
    """Train a LoRA or DoRA (peft) on the phase's init weights instead of every UNet weight."""

    type: Literal["lora", "dora"] = "lora"
    rank: int = Field(4, ge=1)
    alpha: float | None = Field(None, gt=0)
    """LoRA scale numerator: the update is ``alpha / rank · B·A``; null: ``rank`` (scale 1)."""
    dropout: float = Field(0.0, ge=0, lt=1)
    targets: list[AdapterTarget] = ["self_attention"]
    """Layer groups in words (:data:`ADAPTER_TARGETS`); mapped to diffusers module names in :mod:`model.adapters`."""
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
    """One training phase: its data mix and hyper-parameters."""

    description: str = ""
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
    flow_shift: float = Field(1.0, gt=0)
    """Flow matching: σ ↦ shift·σ / (1 + (shift − 1)·σ) in training and sampling (SD3: 3.0 at 1024²)."""
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
    def _counts_match_samples(self) -> Phase:
        if self.mix_is_counts and sum(self.mix.values()) != self.samples:
            raise ValueError(
                f"mix: the counts sum to {sum(self.mix.values())} but samples is {self.samples}; make them "
                f"agree (fractions are written with a decimal point, e.g. 1.0): {self.mix}"
            )
        return self


class CategorySampling(Section):
    """Per-category overrides of the eval sampler settings (unset: ``eval.steps`` / ``eval.guidance_scale``)."""

    steps: int | None = Field(None, ge=1)
    guidance_scale: float | None = Field(None, ge=1)


class Fid(Section):
    """FID of the eval images against local reference images, with a local Inception (TorchScript)."""

    inception_path: str | None = None
    """NVlabs ``pt_inception-2015-12-05`` TorchScript file (called as ``model(x, return_features=True)``
    on N×3×H×W floats in 0..255); null: FID skipped."""
    reference_dir: str | None = None
    """Folder of reference images (png/jpg/webp, searched recursively); null: FID skipped."""
    max_reference_images: int = Field(10_000, ge=2)


GUIDANCE_WARN_ABOVE = 9.0
"""CFG above this over-saturates SD1.x samples (the reference run used 7.5 for scenes, 8.5 for people)."""


class Eval(Section):
    """Fixed prompts by category and sampler settings for the per-phase eval grid and its metrics."""

    prompts: dict[SafeName, list[str]]
    """category → prompts. A plain list is one category, ``all`` (the demo's colour/shape probe prompts)."""
    negative_prompt: str = ""
    steps: int = Field(100, ge=1)
    guidance_scale: float = Field(7.5, ge=1)
    sampling: dict[SafeName, CategorySampling] = {}
    """category → steps / guidance_scale for that category (others use the two values above)."""
    seed: int = 1234
    """Prompt ``i`` of a category is sampled with seed ``seed + i``, in every phase."""
    columns: int = Field(4, ge=1)
    batch_size: int = Field(8, ge=1)
    clip_model_path: str | None = None
    """Local folder of a transformers ``CLIPModel`` + processor (e.g. openai/clip-vit-large-patch14
    saved with ``save_pretrained``); null: CLIP score skipped."""
    fid: Fid = Fid()
    extra_sizes: list[tuple[Annotated[int, Field(gt=0)], Annotated[int, Field(gt=0)]]] = []
    """(width, height) of extra, usually non-square, cells: the first ``extra_prompts`` prompts of the first
    category sampled at each size (same seeds and settings as their square cells), shown as rows below the
    square cells and probed apart. Each side must be a multiple of the model's pixel multiple (checked
    against the loaded model before any sampling; SD 1.x: 64)."""
    extra_prompts: int = Field(4, ge=1)
    """How many of the first category's prompts each ``extra_sizes`` entry samples (all of them if fewer)."""

    @field_validator("extra_sizes")
    @classmethod
    def _extra_sizes_distinct(cls, sizes: list[tuple[int, int]]) -> list[tuple[int, int]]:
        repeated = sorted({f"{w}x{h}" for w, h in sizes if sizes.count((w, h)) > 1})
        if repeated:
            raise ValueError(f"sizes listed twice: {repeated}")
        return sizes

    @field_validator("prompts", mode="before")
    @classmethod
    def _list_is_one_category(cls, prompts: object) -> object:
        return {"all": prompts} if isinstance(prompts, list) else prompts

    @field_validator("prompts")
    @classmethod
    def _non_empty(cls, prompts: dict[str, list[str]]) -> dict[str, list[str]]:
        if not prompts:
            raise ValueError("needs at least one category of prompts")
        empty = sorted(name for name, texts in prompts.items() if not texts)
        if empty:
            raise ValueError(f"categories without prompts: {empty}")
        return prompts

    @model_validator(mode="after")
    def _sampling_names_categories(self) -> Eval:
        unknown = sorted(set(self.sampling) - set(self.prompts))
        if unknown:
            raise ValueError(f"sampling: unknown categor(ies) {unknown}; defined under 'prompts': {list(self.prompts)}")
        for name in self.prompts:
            guidance = self.settings(name)[1]
            if guidance > GUIDANCE_WARN_ABOVE:
                log.warning(
                    "eval: category %r samples with guidance_scale %.1f > %.0f (over-saturated SD1.x images; "
                    "the reference run used 7.5 for scenes, 8.5 for people)",
                    name,
                    guidance,
                    GUIDANCE_WARN_ABOVE,
                )
        return self

    @property
    def all_prompts(self) -> list[str]:
        """Every prompt, category by category, in file order."""
        return [p for texts in self.prompts.values() for p in texts]

    def settings(self, category: str) -> tuple[int, float]:
        """``(steps, guidance_scale)`` for ``category``."""
        over = self.sampling.get(category, CategorySampling())
        steps = self.steps if over.steps is None else over.steps
        return steps, self.guidance_scale if over.guidance_scale is None else over.guidance_scale


_DNS_LABEL = re.compile(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?")


def check_dns_label(name: str) -> str:
    """Return ``name`` if Kubernetes accepts it as a namespace, service account or claim name (RFC 1123 label)."""
    if not _DNS_LABEL.fullmatch(name):
        raise ValueError(f"not a Kubernetes name: lower-case letters, digits and '-', at most 63; got {name!r}")
    return name


DnsLabel = Annotated[str, AfterValidator(check_dns_label)]


class Cluster(Section):
    """Kubernetes: the flows' pods (a Prefect Kubernetes work pool) and multi-node training jobs (docs/CLUSTER.md).

    Nothing here is a credential: S3 access comes from ``service_account`` (IRSA / workload identity), MLflow's
    address is a URL without a password. Off (``enabled: false``): every stage runs where the flow runs."""

    enabled: bool = False
    """On: with ``train.nnodes > 1`` the train stage submits an Indexed Job of ``nnodes`` pods (sdforge/cluster)."""
    image: str | None = None
    """The image built by ``make image`` (``registry/sdforge:<git sha>``); the flows' pods and the training pods."""
    namespace: DnsLabel = "sdforge"
    service_account: DnsLabel = "sdforge"
    """The pods' service account: the one that grants the S3 bucket (no keys in any manifest or the image)."""
    gpu_resource: str = "nvidia.com/gpu"
    gpus_per_pod: int | None = Field(None, ge=0)
    """GPUs requested per training pod; null: ``train.nproc_per_node`` (any other value is an error)."""
    cpu: str = "16"
    memory: str = "200Gi"
    shm_size: str = "64Gi"
    """Size of the memory-backed ``/dev/shm`` (an ``emptyDir`` with ``medium: Memory``): NCCL and data loaders."""
    node_selector: dict[str, str] = {}
    tolerations: list[dict[str, str]] = []
    work_pvc: DnsLabel | None = None
    """A ReadWriteMany claim holding the work dir (``paths.*``, DVC cache): required with ``train.nnodes > 1``, so
    that every training pod reads the phase's inputs and rank 0's outputs land where the flow's pod hashes them."""
    cache_pvc: DnsLabel | None = None
    """A claim for ``HF_HOME`` (model downloads); null: an ``emptyDir`` per pod."""
    repo_dir: str = "/opt/sdforge"
    """Where the image holds the repo (the pods' working directory; relative ``paths.*`` resolve under it)."""
    mlflow_tracking_uri: Url | None = None
    """``MLFLOW_TRACKING_URI`` of the pods (an in-cluster MLflow server)."""
    rdzv_port: int | None = Field(29400, ge=1, le=65535)
    """torchrun's c10d rendezvous port on pod 0 of a training job (its host is pod 0's stable DNS name; the job
    sets ``train.rdzv_endpoint`` from it). Required with ``train.nnodes > 1``."""
    job_ttl_s: int = Field(86400, ge=0)
    """Seconds a finished training job (and its pods' logs) stays before Kubernetes deletes it."""


class Params(Section):
    """The whole ``params.yaml``."""

    paths: Paths
    tracking: Tracking = Tracking()
    storage: Storage = Storage()
    demo: DemoData
    sources: dict[SafeName, Source]
    models: Models
    buckets: dict[SafeName, BucketSet] = {}
    """Resolution name → its aspect-ratio buckets; empty: one square set ``square`` of ``encode.resolution``."""
    encode: Encode = Encode()
    train: Train = Train()
    phases: dict[PhaseName, Phase]
    eval: Eval
    cluster: Cluster = Cluster()

    def bucket_sets(self) -> dict[str, BucketSet]:
        """``buckets``, or ``{"square": [encode.resolution]²}`` when none are defined."""
        if self.buckets:
            return dict(self.buckets)
        r = self.encode.resolution
        return {"square": BucketSet(sizes=[(r, r)], step=r)}

    def encoded_resolutions(self) -> list[str]:
        """The bucket sets every source is encoded at (``encode.resolutions``, default all)."""
        return list(self.encode.resolutions) or list(self.bucket_sets())

    def phase_resolution(self, phase: str) -> str:
        """The bucket set phase ``phase`` trains on."""
        return self.phases[phase].resolution or next(iter(self.bucket_sets()))

    def phase_objective(self, phase: str) -> str:
        """``diffusion`` or ``flow_matching``: the phase's own ``objective``, else ``train.objective``."""
        return self.phases[phase].objective or self.train.objective

    @model_validator(mode="after")
    def _resolutions_defined(self) -> Params:
        sets = self.bucket_sets()
        unknown = sorted(set(self.encode.resolutions) - set(sets))
        if unknown:
            raise ValueError(f"encode.resolutions: {unknown} not defined under 'buckets' ({sorted(sets)})")
        for name, phase in self.phases.items():
            if phase.resolution is None and len(sets) > 1:
                raise ValueError(f"phases.{name}.resolution: required when several bucket sets exist ({sorted(sets)})")
            if phase.resolution is not None and phase.resolution not in self.encoded_resolutions():
                raise ValueError(
                    f"phases.{name}.resolution: '{phase.resolution}' is not encoded; encoded bucket sets: "
                    f"{self.encoded_resolutions()} (see 'buckets' and encode.resolutions)"
                )
        return self

    @model_validator(mode="after")
    def _min_snr_only_for_diffusion(self) -> Params:
        for name, phase in self.phases.items():
            if self.phase_objective(name) == "flow_matching" and phase.min_snr_gamma is not None:
                raise ValueError(
                    f"phases.{name}.min_snr_gamma: Min-SNR-γ weights the diffusion objective's timesteps; set it "
                    "to null for a flow_matching phase"
                )
        return self

    @model_validator(mode="after")
    def _multi_node_needs_rendezvous(self) -> Params:
        train = self.train
        if train.nnodes > 1 and self.cluster.enabled and self.cluster.rdzv_port is None:
            raise ValueError(f"train.nnodes {train.nnodes} > 1 on the cluster needs cluster.rdzv_port (pod 0's port)")
        if train.nnodes > 1 and not self.cluster.enabled and not train.rdzv_endpoint:
            raise ValueError(
                f"train.nnodes {train.nnodes} > 1 needs train.rdzv_endpoint ('host:port' of node 0), or "
                "cluster.enabled: true (a Kubernetes job sets it)"
            )
        return self

    @model_validator(mode="after")
    def _cross_references(self) -> Params:
        for name, phase in self.phases.items():
            unknown = sorted(set(phase.mix) - set(self.sources))
            if unknown:
                raise ValueError(
                    f"phases.{name}.mix: unknown source(s) {unknown}; defined under 'sources': {sorted(self.sources)}"
                )
        earlier: list[str] = []
        for name, phase in self.phases.items():
            if phase.init_from != SCRATCH and phase.init_from not in earlier:
                raise ValueError(
                    f"phases.{name}.init_from: must be '{SCRATCH}' or an earlier phase "
                    f"{earlier}; got '{phase.init_from}'"
                )
            earlier.append(name)
        return self

    def phase_names(self) -> list[str]:
        """Phases in declaration order."""
        return list(self.phases)


def _key_path(loc: tuple[int | str, ...]) -> str:
    """The dotted key path, e.g. ``sources.laion.repo``; a rejected dict key (pydantic's loc
    ``(..., '../x', '[key]')``) reads ``sources key '../x'``."""
    if len(loc) >= 2 and loc[-1] == "[key]":
        return f"{'.'.join(str(p) for p in loc[:-2])} key {loc[-2]!r}"
    return ".".join(str(p) for p in loc) or "<root>"


def _format_error(err: ValidationError, origin: str) -> str:
    """One line per error: ``origin: key.path: message (got value)``; a value that may hold credentials,
    or that the message already quotes, is not repeated."""
    lines = []
    for e in err.errors():
        msg = e["msg"].removeprefix("Value error, ")
        got = e.get("input")
        hidden = isinstance(got, dict) or (isinstance(got, str) and (url_has_credentials(got) or repr(got) in msg))
        got_text = "" if hidden else f" (got {got!r})"
        lines.append(f"{origin}: {_key_path(e['loc'])}: {msg}{got_text}")
    return "\n".join(lines)


def parse_params(data: dict, origin: str = "params") -> Params:
    """Validate an already-loaded params dict; raise :class:`ConfigError` naming every bad key."""
    try:
        return Params.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_error(err, origin)) from None


def load_params(path: str | Path = "params.yaml") -> Params:
    """Load and validate ``params.yaml``; raise :class:`ConfigError` naming every bad key."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: params file not found (run from the repo root or pass --params)")
    with path.open() as fh:
        data = yaml.safe_load(fh) or {}
    return parse_params(data, origin=str(path))
