"""What a phase's trained weights depend on, declared once: the run-dir fingerprint is computed from it, and a test
holds it against the ``train`` stage's ``deps`` and ``params`` in ``dvc.yaml``.

A phase's weights are a function of
- **params**: the keys of ``train`` and ``phases.<p>`` that the config classes mark :attr:`Effect.WEIGHTS`
  (:func:`sdforge.config.key_effect`; reporting, retention and failure-handling keys are ``NONE``, the
  job's shape is ``JOB``: a run resumes across a change of those), all of ``models.unet`` and
  ``models.noise``, and the keys of ``models.denoiser`` and ``models.mmdit`` that differ from their defaults (so a
  run recorded before the MM-DiT family existed keeps its fingerprint, and any change of them changes the record);
- **files** (:data:`INPUT_FILES`): the phase's index, its init weights, the models it trains with (noise
  scheduler, tokenizer(s), frozen text encoder(s), empty-prompt embedding) and the latent shards its index points
  into (identified by what ``encode_latents`` records of each shard: input tar sha256, encoder, captions,
  sample count — reading shard metadata, not terabytes of latents).

Code is deliberately *not* an input: a bug fix in the loop must be able to resume a run that took days. To
retrain a phase after a code change, move its run dir away (``sdforge runs``).

The :class:`InputRecord` of a run (every param value and file digest) is kept in the run dir
(``inputs.json``); a run dir whose record differs is never resumed, and the keys or files that differ are
named when it is moved aside (:mod:`sdforge.training.run_dir`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq

from sdforge.config import Effect, MMDiTSpec, Params, Phase, Train, key_effect
from sdforge.config.models import Denoiser
from sdforge.latents.store import part_name, resolution_dir

INPUT_PARAMS = ("phases.${key}", "train", "models.unet", "models.noise", "models.denoiser", "models.mmdit")
"""The params sections a phase's weights read, as ``dvc.yaml`` lists them (``train`` and ``phases.${key}`` are
filtered by :func:`sdforge.config.key_effect`; :data:`NON_DEFAULT_SECTIONS` keep their non-default keys only)."""
FILTERED_SECTIONS = {"train": Train, "phases.${key}": Phase}
NON_DEFAULT_SECTIONS = {"models.denoiser": Denoiser, "models.mmdit": MMDiTSpec}
"""Sections added with the MM-DiT family: recorded only where they differ from their defaults."""

INPUT_FILES = {
    "index": "${paths.mixes}/${key}.parquet",
    "held_out": "${paths.mixes}/${key}.held_out.parquet",
    "init": "${paths.checkpoints}/${item.init_from}",
    "models": "${paths.models}",
    "latents": "${paths.latents}",
    "conditions": "${paths.mixes}/${key}.conditions.json",
}
"""The files a phase's weights read, by name, as ``dvc.yaml`` lists them. ``conditions`` (``mix_phase``'s record of
the condition shards a ControlNet phase reads) counts for ControlNet phases only: the records of runs made before it
existed stay equal for every other phase."""
MODEL_FILES = (
    "scheduler", "tokenizer", "text_encoder", "uncond_embedding.safetensors", "tokenizer_2", "text_encoder_2",
)  # fmt: skip
"""What training reads of ``paths.models`` (the VAE only samples validation images, which change no weight); the
second encoder's folders exist for the mmdit family only (a missing folder adds nothing to the digest)."""


RECLASSIFIED = frozenset({"train.gradient_checkpointing"})
"""Keys an older sdforge counted among the weights' inputs and this one does not (``gradient_checkpointing`` became
the job-shape key ``activation_checkpointing``): a run dir whose recorded inputs differ from today's in these keys
only is the same run, kept and restamped (:func:`sdforge.training.run_dir.open_run_dir`)."""


@dataclass(frozen=True)
class InputRecord:
    """A phase's inputs: ``params`` (dotted key → value) and ``files`` (name → digest)."""

    params: dict
    files: dict

    @property
    def fingerprint(self) -> str:
        """16 hex digits of the record's sha256: equal for equal inputs on any machine."""
        text = json.dumps({"params": self.params, "files": self.files}, sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def to_json(self) -> dict:
        return {"fingerprint": self.fingerprint, "params": self.params, "files": self.files}

    def differences(self, other: dict) -> list[str]:
        """The params keys and file names whose value differs from ``other`` (a stored :meth:`to_json`), sorted."""
        keys = [k for k in sorted(set(self.params) | set(other.get("params", {}))) if _differs(k, self.params, other)]
        theirs = other.get("files", {})
        files = [f"file {n} ({INPUT_FILES.get(n, n)})" for n in sorted(set(self.files) | set(theirs))
                 if self.files.get(n) != theirs.get(n)]  # fmt: skip
        return keys + files


def _differs(key: str, ours: dict, stored: dict) -> bool:
    theirs = stored.get("params", {})
    return key not in ours or key not in theirs or _canonical(ours[key]) != _canonical(theirs[key])


def _canonical(value) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def phase_inputs(params: Params, phase_name: str) -> InputRecord:
    """The record of ``phase_name``'s inputs: the weight-changing params and the digests of :data:`INPUT_FILES`."""
    return InputRecord(weight_params(params, phase_name), input_digests(params, phase_name))


def weight_params(params: Params, phase_name: str) -> dict:
    """Every params key of :data:`INPUT_PARAMS` that changes the weights, dotted, with its value (JSON form)."""
    data = params.model_dump(mode="json")
    out = {}
    for section in INPUT_PARAMS:
        path = section.replace("${key}", phase_name)
        values = data
        for part in path.split("."):
            values = values[part]
        model = FILTERED_SECTIONS.get(section)
        defaults = NON_DEFAULT_SECTIONS[section]().model_dump(mode="json") if section in NON_DEFAULT_SECTIONS else {}
        for key, value in values.items():
            if key in defaults and value == defaults[key]:
                continue
            if model is None or key_effect(model, key) is Effect.WEIGHTS:
                out[f"{path}.{key}"] = value
    return out


def resolve(template: str, params: Params, phase_name: str) -> Path:
    """A ``dvc.yaml`` path template (``${paths.x}``, ``${key}``, ``${item.init_from}``) for ``phase_name``."""
    text = template.replace("${key}", phase_name)
    text = text.replace("${item.init_from}", params.phases[phase_name].init_from)
    for name, value in params.paths.model_dump().items():
        text = text.replace(f"${{paths.{name}}}", str(value))
    return Path(text)


def input_digests(params: Params, phase_name: str) -> dict[str, str]:
    """sha256 per :data:`INPUT_FILES` entry: file bytes (index, held_out, init, models) or shard identities
    (latents)."""
    index = resolve(INPUT_FILES["index"], params, phase_name)
    models = resolve(INPUT_FILES["models"], params, phase_name)
    latents = resolve(INPUT_FILES["latents"], params, phase_name)
    digests = {
        "index": tree_digest(index),
        "held_out": tree_digest(resolve(INPUT_FILES["held_out"], params, phase_name)),
        "init": tree_digest(resolve(INPUT_FILES["init"], params, phase_name)),
        "models": tree_digest(*(models / name for name in MODEL_FILES)),
        "latents": latent_shards_digest(index, latents, params.phase_resolution(phase_name)),
    }
    if params.phases[phase_name].controlnet is not None:
        digests["conditions"] = tree_digest(resolve(INPUT_FILES["conditions"], params, phase_name))
    return digests


def tree_digest(*roots: Path) -> str:
    """sha256 over the relative names and bytes of every file under ``roots`` (a missing root counts as empty)."""
    h = hashlib.sha256()
    for root in roots:
        for f in sorted([root] if root.is_file() else root.rglob("*")):
            if f.is_file():
                h.update(f.relative_to(root.parent).as_posix().encode())
                _hash_file(h, f)
    return h.hexdigest()


def _hash_file(h, path: Path, chunk: int = 16 << 20) -> None:
    """Feed ``path``'s bytes to ``h`` in chunks (a 3.4 GB checkpoint is never held in memory whole)."""
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)


def latent_shards_digest(index: Path, latents_dir: Path, resolution: str) -> str:
    """sha256 of what ``encode_latents`` recorded of each latent shard the index uses (input tar, encoder,
    captions, counts: the part's parquet metadata). A missing index or part leaves the loader to report it."""
    h = hashlib.sha256()
    if not index.is_file():
        return h.hexdigest()
    used = pq.read_table(index, columns=["source", "shard"]).group_by(["source", "shard"]).aggregate([])
    for source, shard in sorted(zip(used["source"].to_pylist(), used["shard"].to_pylist(), strict=True)):
        part = resolution_dir(latents_dir, source, resolution) / part_name(int(shard))
        meta = pq.read_schema(part).metadata or {} if part.is_file() else {}
        entries = sorted((k.decode(), v.decode()) for k, v in meta.items() if k != b"ARROW:schema")
        h.update(json.dumps([source, int(shard), entries]).encode())
    return h.hexdigest()
