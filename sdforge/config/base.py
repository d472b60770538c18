"""What every config section shares: the :class:`Section` base (numbers finite, never a boolean), :class:`ConfigError`,
the checks of names that become path components and of URLs (never credentials), the annotated types built on
them and the numeric ones that ``params.yaml`` and the ``sdforge`` flags share (:data:`PositiveInt`,
:data:`GuidanceScale`, :data:`Seed`), and the weight-effect classification of keys (:class:`Effect`,
:func:`key_effect`, :func:`keys_by_effect`).
"""

from __future__ import annotations

import re
import types
from enum import StrEnum
from typing import Annotated, Any, ClassVar, Union, get_args, get_origin

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, field_validator

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


# --- what a key's value changes -----------------------------------------------------------------------------------


class Effect(StrEnum):
    """What changing a key changes, for the keys of ``train`` and ``phases.<p>``: the train stage's run-dir
    fingerprint hashes exactly their :attr:`WEIGHTS` keys, so a run dir is resumed across a change of any other
    key and started afresh on a change of one of those (sdforge/training)."""

    WEIGHTS = "weights"
    """Changing it changes the trained weights: a run dir from another value is not resumed."""
    NONE = "none"
    """Reporting, retention, failure handling: a run resumes across a change, bit-identically."""
    JOB = "job"
    """The job's shape (world size): a run resumes with its global batch kept (docs/RESILIENCE.md)."""


# --- numbers: finite, never a boolean ---------------------------------------------------------------------------

MAX_SEED = 2**63 - 1
"""The largest seed: ``torch.Generator.manual_seed`` takes a 64-bit integer, numpy any non-negative one."""

PositiveInt = Annotated[int, Field(ge=1)]
"""A count or size that must be at least 1 (steps, images, batch size, an image side)."""
GuidanceScale = Annotated[float, Field(ge=1, allow_inf_nan=False)]
"""A classifier-free guidance scale: 1 is no guidance (the negative prompt unused); below 1 means nothing."""
Seed = Annotated[int, Field(ge=0, le=MAX_SEED)]
"""A seed of torch's and numpy's generators: ``0 … 2**63 - 1``."""
BOOL_FOR_NUMBER = "expected a number, got a boolean (true/false): write the number"


def _members(annotation: Any) -> list[Any]:
    """The types a value of ``annotation`` may be: ``Annotated`` and unions (``X | None``) unwrapped."""
    origin = get_origin(annotation)
    if origin is Annotated:
        return _members(get_args(annotation)[0])
    if origin in (Union, types.UnionType):
        return [member for arg in get_args(annotation) for member in _members(arg)]
    return [annotation]


def bool_for_number(annotation: Any, value: Any) -> bool:
    """True when ``value`` holds a boolean where ``annotation`` wants a number (int or float) and no boolean:
    pydantic's lax mode reads ``true`` as 1, so ``batch_size: true`` would be a batch of one. Looks into lists,
    tuples and dict values; a nested :class:`Section` checks its own fields."""
    members = _members(annotation)
    if isinstance(value, bool):
        return bool not in members and Any not in members and any(m in (int, float) for m in members)
    for member in members:
        origin, args = get_origin(member), get_args(member)
        if isinstance(value, dict) and origin is dict and len(args) == 2:
            return any(bool_for_number(args[1], item) for item in value.values())
        if isinstance(value, list | tuple) and origin in (list, tuple, set, frozenset) and args:
            if origin is tuple and Ellipsis not in args:
                return len(args) == len(value) and any(map(bool_for_number, args, value))
            return any(bool_for_number(args[0], item) for item in value)
    return False


class Section(BaseModel):
    """Base of every config section: immutable, unknown keys rejected, every float finite (``.inf``/``.nan``
    refused) and no boolean taken for a number (``batch_size: true`` refused, :func:`bool_for_number`). A rejected
    value is left out of pydantic's own message (it may be a credential); :func:`sdforge.config.parse_params`
    shows the safe ones.

    ``EFFECT`` is what the keys a class declares change (:func:`key_effect`); a field overrides it with
    ``Annotated[<type>, Effect.<...>]``."""

    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True, allow_inf_nan=False)

    EFFECT: ClassVar[Effect] = Effect.WEIGHTS

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_a_number(cls, value: Any, info: ValidationInfo) -> Any:
        if info.field_name is not None and bool_for_number(cls.model_fields[info.field_name].annotation, value):
            raise ValueError(BOOL_FOR_NUMBER)
        return value


RGB = tuple[int, int, int]


def key_effect(model: type[BaseModel], field: str) -> Effect:
    """What changing ``model``'s key ``field`` changes: the field's own :class:`Effect` metadata if it has one,
    else the ``EFFECT`` of the class that declares it (the first in ``model.__mro__`` whose own annotations
    hold it; :attr:`Effect.WEIGHTS` for a class without one). The train stage's run-dir fingerprint hashes
    exactly the :attr:`Effect.WEIGHTS` keys of ``train`` and ``phases.<p>``."""
    if field not in model.model_fields:
        raise KeyError(f"{model.__name__} has no key {field!r}")
    own = [meta for meta in model.model_fields[field].metadata if isinstance(meta, Effect)]
    if own:
        return own[-1]
    declaring = next(cls for cls in model.__mro__ if field in vars(cls).get("__annotations__", {}))
    return getattr(declaring, "EFFECT", Effect.WEIGHTS)


def keys_by_effect(model: type[BaseModel]) -> dict[str, Effect]:
    """Every key of ``model`` → what changing it changes (:func:`key_effect`), in field order; e.g. the
    :attr:`Effect.WEIGHTS` keys of :class:`sdforge.config.Train` are the ``train`` settings a run dir's
    fingerprint covers."""
    return {field: key_effect(model, field) for field in model.model_fields}
