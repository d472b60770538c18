"""The whole ``params.yaml`` (:class:`Params`), its cross-section checks, and the loader: :func:`load_params` and
:func:`parse_params` raise :class:`ConfigError` with one line per bad key, naming its key path."""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import ValidationError, model_validator

from sdforge.config.base import SCRATCH, ConfigError, PhaseName, SafeName, Section, url_has_credentials
from sdforge.config.cluster import Cluster
from sdforge.config.demo import DemoData
from sdforge.config.eval import Eval
from sdforge.config.latents import BucketSet, Encode
from sdforge.config.models import Models
from sdforge.config.paths import Paths, Storage, Tracking
from sdforge.config.phases import Phase
from sdforge.config.sources import Source
from sdforge.config.train import Train


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
