"""Typed, validated configuration for every stage, loaded from ``params.yaml``.

One loader (:func:`load_params`) for the whole project. Every section is a frozen
pydantic model with ``extra="forbid"``: an unknown key, a wrong type or an impossible
value fails at load time with the key path and what was expected, e.g.::

    params.yaml: phases.phase3.mix.laoin: phase mixes a source that is not defined
    under 'sources' (defined: diffusiondb, laion)

Stage modules take only their own section(s); they never see the raw dict.

One module per domain, each section beside its checks; import from here (``from sdforge.config import Phase``):

- :mod:`~sdforge.config.base`: :class:`Section` (floats finite, no boolean for a number), :class:`ConfigError`,
  safe names, URL/credential checks, the numeric types the params and the ``sdforge`` flags share
  (``PositiveInt``, ``GuidanceScale``, ``Seed``), the weight-effect classification (:class:`Effect`,
  :func:`keys_by_effect`)
- :mod:`~sdforge.config.paths`: ``paths``, ``tracking``, ``storage``
- :mod:`~sdforge.config.demo`: ``demo``
- :mod:`~sdforge.config.sources`: ``sources.<name>`` (filter, fetch, per-kind options, recaption)
- :mod:`~sdforge.config.models`: ``models``
- :mod:`~sdforge.config.latents`: ``buckets``, ``encode``
- :mod:`~sdforge.config.conditions`: ``conditions`` (ControlNet conditioning images)
- :mod:`~sdforge.config.train`: ``train``, one class per concern
- :mod:`~sdforge.config.phases`: ``phases.<p>`` (adapter, caption mix)
- :mod:`~sdforge.config.eval`: ``eval``
- :mod:`~sdforge.config.cluster`: ``cluster``
- :mod:`~sdforge.config.params`: the whole file (:class:`Params`) and the loader
- :mod:`~sdforge.config.arguments`: the ``sdforge`` command's flags, validated with the same types
"""

from sdforge.config.base import (
    CREDENTIALS_HINT,
    MAX_NAME_LENGTH,
    MAX_SEED,
    RESERVED_PHASE_NAMES,
    RGB,
    SCRATCH,
    ConfigError,
    Effect,
    GuidanceScale,
    PhaseName,
    PositiveInt,
    S3Url,
    SafeName,
    Section,
    Seed,
    Url,
    bool_for_number,
    check_no_credentials,
    check_phase_name,
    check_s3_url,
    check_safe_name,
    key_effect,
    keys_by_effect,
    redact_credentials,
    url_has_credentials,
)
from sdforge.config.cluster import Cluster, DnsLabel, check_dns_label
from sdforge.config.conditions import CONDITION_KINDS, CannySettings, Conditions
from sdforge.config.demo import DemoConcept, DemoData, DemoWebdump
from sdforge.config.eval import GUIDANCE_WARN_ABOVE, CategorySampling, CocoProtocol, Eval, Fid
from sdforge.config.latents import BucketSet, Encode
from sdforge.config.models import (
    EVAL_CLIP_DIR,
    FID_INCEPTION_FILE,
    CaptionerBuild,
    MMDiTSpec,
    Models,
    NoiseSchedule,
    TextEncoderBuild,
    UNetSpec,
    VaeBuild,
)
from sdforge.config.params import Params, load_params, parse_params, read_yaml_bounded
from sdforge.config.paths import Paths, Storage, Tracking
from sdforge.config.phases import ADAPTER_TARGETS, Adapter, AdapterTarget, CaptionMix, ControlNet, Distill, Phase
from sdforge.config.sources import (
    CocoOptions,
    Columns,
    FaceOptions,
    FetchSettings,
    FilterRules,
    InputLimits,
    JourneyDbOptions,
    LocalOptions,
    Recaption,
    Shorten,
    Source,
)
from sdforge.config.train import (
    CheckpointSettings,
    EmaSettings,
    LaunchSettings,
    MemorySettings,
    OptimizerSettings,
    PrecisionSettings,
    ReportingSettings,
    ResilienceSettings,
    Train,
    TrainingRecipe,
)

__all__ = [
    "EVAL_CLIP_DIR",
    "FID_INCEPTION_FILE",
    "ADAPTER_TARGETS",
    "CREDENTIALS_HINT",
    "GUIDANCE_WARN_ABOVE",
    "MAX_NAME_LENGTH",
    "MAX_SEED",
    "RESERVED_PHASE_NAMES",
    "RGB",
    "SCRATCH",
    "Adapter",
    "AdapterTarget",
    "BucketSet",
    "CONDITION_KINDS",
    "CannySettings",
    "Conditions",
    "CaptionMix",
    "ControlNet",
    "Distill",
    "CaptionerBuild",
    "CategorySampling",
    "CheckpointSettings",
    "Cluster",
    "CocoOptions",
    "Columns",
    "ConfigError",
    "DemoConcept",
    "DemoData",
    "DemoWebdump",
    "DnsLabel",
    "Effect",
    "EmaSettings",
    "Encode",
    "CocoProtocol",
    "Eval",
    "FaceOptions",
    "FetchSettings",
    "Fid",
    "FilterRules",
    "GuidanceScale",
    "JourneyDbOptions",
    "LaunchSettings",
    "MemorySettings",
    "InputLimits",
    "LocalOptions",
    "Models",
    "NoiseSchedule",
    "OptimizerSettings",
    "Params",
    "Paths",
    "Phase",
    "PhaseName",
    "PositiveInt",
    "PrecisionSettings",
    "Recaption",
    "ReportingSettings",
    "ResilienceSettings",
    "S3Url",
    "SafeName",
    "Section",
    "Seed",
    "Shorten",
    "Source",
    "Storage",
    "TextEncoderBuild",
    "Tracking",
    "Train",
    "TrainingRecipe",
    "MMDiTSpec",
    "UNetSpec",
    "Url",
    "VaeBuild",
    "bool_for_number",
    "check_dns_label",
    "check_no_credentials",
    "check_phase_name",
    "check_s3_url",
    "check_safe_name",
    "key_effect",
    "keys_by_effect",
    "load_params",
    "parse_params",
    "read_yaml_bounded",
    "redact_credentials",
    "url_has_credentials",
]
