"""The demo shrunk to a test's size (2 phases, the second an adapter; a few steps each): the end-to-end test and
the kill harness."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import yaml

RECAPTION_OVERLAY = Path(__file__).resolve().parents[1] / "configs" / "demo-recaption" / "overlay.yaml"
"""What ``make demo-recaption`` merges onto the demo params (docs/CAPTIONS.md)."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shrink(params: dict, port: int) -> dict:
    """The demo params, made small enough for a test: 2 phases (demo phase 0 at its low resolution, then the
    demo's adapter phase 8 at the high one: a resolution change and an adapter on it; the first with the post-hoc
    EMA), fewer rows and steps."""
    demo = params["demo"]
    demo.update(laion_rows=96, archive_images=48, http_port=port)
    if demo.get("concept"):
        demo["concept"]["images"] = 32
    params["models"]["vae_build"].update(train_steps=30)
    params["phases"] = {  # phase 1 at the low resolution, phase 2 (an adapter) at the high one
        "phase1": {**params["phases"]["phase0"], "samples": 64, "epochs": 2, "batch_size": 16, "warmup_steps": 2,
                   "posthoc_ema": True},  # the demo chooses its EMA post hoc in phases 1 and 7
        "phase2": {**params["phases"]["phase8"], "init_from": "phase1", "samples": 48, "epochs": 1,
                   "batch_size": 16, "warmup_steps": 1},
    }
    params["train"].update(save_steps=3, log_every=1, held_out=4, val_loss_every=2)
    prompts = params["eval"]["prompts"]
    if isinstance(prompts, dict):  # categories (the demo: seen, held_out, concept): two prompts of each
        prompts = {name: texts[:2] for name, texts in prompts.items()}
    else:
        prompts = prompts[:4]
    params["eval"].update(prompts=prompts, steps=4, batch_size=4, columns=2)
    return params


def with_recaption(params: dict) -> dict:
    """``params`` (shrunk) plus ``make demo-recaption``'s overlay, small: a 48-image ``webdump`` source captioned
    with file names, recaptioned by a 40-step demo captioner (it learns little: the harness checks that nothing is
    lost or redone, not caption quality), and mixed into the first phase at half synthetic captions (the kill
    harness's ``--recaption``)."""
    overlay = yaml.safe_load(RECAPTION_OVERLAY.read_text())
    overlay["demo"]["webdump"]["images"] = 48
    overlay["models"]["captioner_build"]["steps"] = 40
    overlay.pop("phases")
    params = merged(params, overlay)
    first = next(iter(params["phases"]))
    params["phases"][first].update(mix={"laion": 0.5, "webdump": 0.5}, caption_mix={"original": 0.5, "synthetic": 0.5})
    return params


def merged(base: dict[str, Any], overlay: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``overlay`` merged in: mappings key by key (recursively), anything else replaced."""
    out = dict(base)
    for key, value in overlay.items():
        both = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = merged(out[key], value) if both else value
    return out
