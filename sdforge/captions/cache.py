"""Content keys of synthetic captions: what must change for an image to be captioned again.

A caption is keyed by the image's bytes (sha256) and everything that shapes the generation: model id, revision,
prompt and generation settings (:func:`caption_key`). The settings alone give :func:`settings_fingerprint`: when a
stage's fingerprint differs from the one its earlier output was made with, every image is recaptioned, and
:func:`plan_captions` says so in its counts.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass


def settings_fingerprint(model: str, revision: str | None, prompt: str, generation: Mapping) -> str:
    """sha256 (hex) of the captioner's settings in canonical JSON: model, revision, prompt, generation settings."""
    payload = {"model": model, "revision": revision, "prompt": prompt, "generation": dict(generation)}
    return hashlib.sha256(json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def caption_key(image_sha256: str, fingerprint: str) -> str:
    """The key of one image's caption under one captioner setting."""
    return hashlib.sha256(f"{image_sha256}:{fingerprint}".encode()).hexdigest()


@dataclass(frozen=True)
class CaptionPlan:
    """Which images to caption now, and why the others are not."""

    todo: list[str]
    """Image sha256s without a caption under the current settings, in input order, without repeats."""
    cached: int
    """Images whose caption under the current settings exists already."""
    stale: int
    """Images captioned before under other settings (recaptioned: they are in ``todo``)."""


def plan_captions(images: Iterable[str], done: Mapping[str, str], fingerprint: str) -> CaptionPlan:
    """Split ``images`` (sha256s) by ``done`` (sha256 → the fingerprint its caption was made with)."""
    todo, cached, stale, seen = [], 0, 0, set()
    for sha in images:
        if sha in seen:
            continue
        seen.add(sha)
        made_with = done.get(sha)
        if made_with == fingerprint:
            cached += 1
            continue
        stale += made_with is not None
        todo.append(sha)
    return CaptionPlan(todo=todo, cached=cached, stale=stale)
