"""The whole ``params.yaml`` (:class:`Params`), its cross-section checks, and the loader: :func:`load_params` and
:func:`parse_params` raise :class:`ConfigError` with one line per bad key, naming its key path."""

from __future__ import annotations

import math
import os
from pathlib import Path

import yaml
from pydantic import ValidationError, model_validator

from sdforge.config.base import SCRATCH, ConfigError, PhaseName, SafeName, Section, url_has_credentials
from sdforge.config.cluster import Cluster
from sdforge.config.conditions import Conditions
from sdforge.config.demo import DemoData
from sdforge.config.eval import Eval
from sdforge.config.latents import BucketSet, Encode
from sdforge.config.models import EVAL_CLIP_DIR, FID_INCEPTION_FILE, Models
from sdforge.config.paths import Paths, Storage, Tracking
from sdforge.config.phases import FAMILY_ADAPTER_TARGETS, FAMILY_CAPTION_PARTS, Phase
from sdforge.config.sources import Source
from sdforge.config.train import Train

SD3_SHIFT_BASE_PIXELS = 256 * 256
"""The resolution at which SD3's resolution-dependent shift is 1 (Esser et al. 2024, §5.3.2: α = √(m / n))."""


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
    conditions: Conditions = Conditions()
    """The conditioning images of ControlNet phases (``condition_images``)."""
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

    def eval_clip_path(self) -> str | None:
        """The scoring CLIP's folder: ``eval.clip_model_path``, else ``${paths.models}/eval_clip`` when
        ``models.eval_clip`` has ``prepare_models`` save one there, else None."""
        if self.eval.clip_model_path is not None:
            return self.eval.clip_model_path
        return f"{self.paths.models}/{EVAL_CLIP_DIR}" if self.models.eval_clip else None

    def fid_inception_path(self) -> str | None:
        """The FID Inception file: ``eval.fid.inception_path``, else ``${paths.models}/fid_inception.pt`` when
        ``models.fid_inception`` has ``prepare_models`` copy one there, else None."""
        if self.eval.fid.inception_path is not None:
            return self.eval.fid.inception_path
        return f"{self.paths.models}/{FID_INCEPTION_FILE}" if self.models.fid_inception else None

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
        """A flow-matching phase that leaves ``min_snr_gamma`` unset gets null (its 5.0 default is diffusion's);
        one that sets a value is an error."""
        for name, phase in self.phases.items():
            if self.phase_objective(name) != "flow_matching" or phase.min_snr_gamma is None:
                continue
            if "min_snr_gamma" not in phase.model_fields_set:
                object.__setattr__(phase, "min_snr_gamma", None)  # frozen section: the default depends on the objective
            else:
                raise ValueError(
                    f"phases.{name}.min_snr_gamma: Min-SNR-γ weights the diffusion objective's timesteps; set it "
                    "to null for a flow_matching phase"
                )
        return self

    @model_validator(mode="after")
    def _resolution_shift(self) -> Params:
        """``flow_shift: resolution`` → SD3's ``√(m / 256²)`` for the phase's largest bucket (a number from here on)."""
        for name, phase in self.phases.items():
            if phase.flow_shift == "resolution":
                object.__setattr__(phase, "flow_shift", round(math.sqrt(self._pixels(name) / SD3_SHIFT_BASE_PIXELS), 6))
        return self

    def _pixels(self, phase: str) -> int:
        """The phase's resolution in pixels: its bucket set's ``max_area``, else its largest listed bucket."""
        buckets = self.bucket_sets()[self.phase_resolution(phase)]
        return buckets.max_area if buckets.max_area is not None else max(w * h for w, h in buckets.sizes)

    @model_validator(mode="after")
    def _family_capabilities(self) -> Params:
        """What a phase asks of ``models.denoiser.family`` it has, or an error naming the key."""
        family = self.models.denoiser.family
        for name, phase in self.phases.items():
            _check_family_phase(family, name, phase, self.phase_objective(name))
        return self

    def fsdp_blockers(self, phase: str) -> list[str]:
        """What of ``phase`` (and ``train``) sharded training does not support yet, by key; empty: it does. The train
        stage of such a phase refuses ``train.parallel: fsdp`` naming them (``auto`` replicates it instead): other
        phases of the same params may still shard."""
        p, train, at = self.phases[phase], self.train, f"phases.{phase}"
        checks = {
            f"{at}.adapter": p.adapter is not None,
            f"{at}.distill": p.distill is not None,
            f"{at}.controlnet": p.controlnet is not None,
            f"{at}.optimizer: {p.optimizer}": p.optimizer != "adamw",
            "train.ema_device: cpu": train.ema_device == "cpu",
        }
        return [key for key, blocked in checks.items() if blocked]

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
            _check_learned_words_stay(name, phase, self.phases)
            _check_condition_made(name, phase, self.conditions.kinds)
            earlier.append(name)
        return self

    def phase_names(self) -> list[str]:
        """Phases in declaration order."""
        return list(self.phases)


def _check_learned_words_stay(name: str, phase, phases: dict) -> None:
    """A phase may not start from a phase whose adapter learns words: the words live in the text encoder, which
    a later phase would train and sample without (carrying them over is not built)."""
    base = phases.get(phase.init_from)
    if base is not None and base.adapter is not None and base.adapter.words:
        raise ValueError(
            f"phases.{name}.init_from: '{phase.init_from}' learns words ({base.adapter.words}) in the text "
            f"encoder, which a later phase does not carry over; learn them in the last phase of a lineage, "
            f"or in phases.{name} itself"
        )
    if base is not None and base.adapter is not None and base.adapter.text_encoders:
        raise ValueError(
            f"phases.{name}.init_from: '{phase.init_from}' trains a LoRA on {base.adapter.text_encoders}, which "
            "a later phase does not carry over; train it in the last phase of a lineage"
        )


def _check_condition_made(name: str, phase, kinds: list[str]) -> None:
    """A ControlNet phase's condition must be one ``condition_images`` makes (``conditions.kinds``)."""
    if phase.controlnet is not None and phase.controlnet.condition not in kinds:
        raise ValueError(
            f"phases.{name}.controlnet.condition: '{phase.controlnet.condition}' is not in conditions.kinds {kinds}; "
            "add it there so condition_images makes it for every training sample"
        )


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


MAX_PARAMS_BYTES = 1 << 20
"""A params file's size limit (the full configuration is ~20 KB); ``SDFORGE_MAX_PARAMS_BYTES`` raises it."""
MAX_PARAMS_NODES = 1_000_000
"""Values in a params file with every YAML alias expanded: what validating it walks (an alias bomb of a few
hundred bytes expands to billions)."""


def load_params(path: str | Path = "params.yaml") -> Params:
    """Load and validate ``params.yaml``; raise :class:`ConfigError` naming every bad key."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: params file not found (run from the repo root or pass --params)")
    return parse_params(read_yaml_bounded(path), origin=str(path))


def read_yaml_bounded(path: Path) -> dict:
    """The YAML mapping in ``path`` (``{}`` when empty), read within :data:`MAX_PARAMS_BYTES` and
    :data:`MAX_PARAMS_NODES`; :class:`ConfigError` naming the file and the bound otherwise."""
    limit = int(os.environ.get("SDFORGE_MAX_PARAMS_BYTES", MAX_PARAMS_BYTES))
    size = path.stat().st_size
    if size > limit:
        raise ConfigError(f"{path}: {size:,} bytes, more than a params file may hold ({limit:,}; "
                          "SDFORGE_MAX_PARAMS_BYTES raises it)")  # fmt: skip
    try:
        loader = yaml.SafeLoader(path.read_bytes())  # its reader refuses control characters here already
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {first_line(str(err))}") from None
    try:
        node = loader.get_single_node()
        if node is None:
            return {}
        nodes = _expanded_nodes(node, {})
        if nodes > MAX_PARAMS_NODES:
            raise ConfigError(f"{path}: {nodes:,} values once its YAML aliases are expanded, more than "
                              f"{MAX_PARAMS_NODES:,}: an alias bomb, or aliases nested too deep")  # fmt: skip
        data = loader.construct_document(node)
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {first_line(str(err))}") from None
    except RecursionError:
        raise ConfigError(f"{path}: YAML nested too deep to read") from None
    finally:
        loader.dispose()
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of sections (paths:, sources:, ...), got {type(data).__name__}")
    return data


def _expanded_nodes(node: yaml.Node, sizes: dict[int, int]) -> int:
    """How many nodes ``node`` stands for with aliases expanded (memoised per node: linear in the file)."""
    known = sizes.get(id(node))
    if known is not None:
        return known
    if isinstance(node, yaml.MappingNode):
        total = 1 + sum(_expanded_nodes(k, sizes) + _expanded_nodes(v, sizes) for k, v in node.value)
    elif isinstance(node, yaml.SequenceNode):
        total = 1 + sum(_expanded_nodes(v, sizes) for v in node.value)
    else:
        total = 1
    sizes[id(node)] = total
    return total


def first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else text


FAMILY_OBJECTIVES = {"unet": ("diffusion", "flow_matching"), "mmdit": ("flow_matching",),
                     "sdxl": ("diffusion", "flow_matching")}  # fmt: skip
"""The objectives each ``models.denoiser.family`` trains (the families' ``objectives``; a test holds them equal)."""
FAMILY_LACKS = {
    "unet": {},
    "mmdit": {
        "distill": "consistency distillation is not supported for the mmdit family yet — remove it",
        "controlnet": "its ControlNet (diffusers' SD3ControlNetModel) is not built yet — remove it, or train the "
        "ControlNet on a unet-family phase",
    },
    "sdxl": {
        "distill": "consistency distillation is not supported for the sdxl family yet (its teacher solve does not "
        "carry the images' sizes) — remove it",
        "controlnet": "its ControlNet (SDXL's, with the sizes in its added conditions) is not built yet — remove "
        "it, or train the ControlNet on a unet-family phase",
    },
}
"""Phase capabilities a family does not have yet, with what to do."""


FAMILY_TEXT_ENCODERS = {"unet": ("text_encoder",), "mmdit": ("text_encoder", "text_encoder_2"),
                        "sdxl": ("text_encoder", "text_encoder_2")}  # fmt: skip
"""The text encoders of each family (the families' ``text_encoders``; a test holds them equal)."""


def _check_text_encoder_lora(family: str, where: str, phase: Phase) -> None:
    """``adapter.text_encoders`` must name the family's encoders, and a distillation's teacher needs them frozen."""
    foreign = sorted(set(phase.adapter.text_encoders) - set(FAMILY_TEXT_ENCODERS[family]))
    if foreign:
        raise ValueError(f"{where}.adapter.text_encoders: {foreign} are not text encoders of the {family} family "
                         f"(its encoders: {list(FAMILY_TEXT_ENCODERS[family])})")  # fmt: skip
    if phase.adapter.text_encoders and phase.distill is not None:
        raise ValueError(f"{where}.adapter.text_encoders: a distillation's teacher reads the frozen encoders — "
                         "leave it [] in a distill phase")  # fmt: skip


def _check_family_phase(family: str, name: str, phase: Phase, objective: str) -> None:
    """A ValueError naming the key of ``phases.<name>`` that the family cannot train (docs/MMDIT.md)."""
    where = f"phases.{name}"
    if objective not in FAMILY_OBJECTIVES[family]:
        raise ValueError(f"{where}.objective (or train.objective): the {family} family trains "
                         f"{' or '.join(FAMILY_OBJECTIVES[family])}; got {objective}")  # fmt: skip
    unknown_parts = sorted(set(phase.caption_dropout) - set(FAMILY_CAPTION_PARTS[family]))
    if unknown_parts:
        raise ValueError(f"{where}.caption_dropout: {unknown_parts} are not conditioning parts of the {family} "
                         f"family (its parts: {list(FAMILY_CAPTION_PARTS[family]) or 'none'})")  # fmt: skip
    if phase.adapter is not None:
        foreign = sorted(set(phase.adapter.targets) - set(FAMILY_ADAPTER_TARGETS[family]))
        if foreign:
            raise ValueError(f"{where}.adapter.targets: {foreign} are not layer groups of the {family} family "
                             f"(its groups: {list(FAMILY_ADAPTER_TARGETS[family])})")  # fmt: skip
    if phase.adapter is not None:
        _check_text_encoder_lora(family, where, phase)
    asked = {"adapter.words": phase.adapter is not None and bool(phase.adapter.words),
             "distill": phase.distill is not None, "controlnet": phase.controlnet is not None}  # fmt: skip
    for key, why in FAMILY_LACKS[family].items():
        if asked[key]:
            raise ValueError(f"{where}.{key}: {why}")
