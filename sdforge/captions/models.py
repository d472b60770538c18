"""The captioning stage's models: which weights a ``recaption`` section names, what its captions are keyed on,
and the batched generate functions of each backend.

- ``recaption.model: build`` is the demo's captioner, trained by ``prepare_models`` into
  ``paths.models``/:data:`BUILT_CAPTIONER`.
- A local folder is keyed on the sha256 of its files (retraining it recaptions everything); a hub id on its
  ``revision`` (pin one: ``main`` moves, and the cache cannot see it move).
- ``backend: transformers`` runs :func:`sdforge.captions.captioner.generate`; ``backend: vllm`` the same
  model in vLLM (installed apart, CUDA only), greedy, one request per image.
- ``shorten``: a text model (``AutoModelForCausalLM``, or ``AutoModelForSeq2SeqLM`` for encoder-decoders)
  rewrites each caption with its prompt; its output is judged like the first pass's.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from sdforge.captions.cache import settings_fingerprint
from sdforge.captions.captioner import generate, load_captioner
from sdforge.config import Recaption, Shorten
from sdforge.io import InputError

log = logging.getLogger(__name__)

BUILD = "build"
BUILT_CAPTIONER = "captioner"
"""The demo captioner's folder under ``paths.models``."""


def folder_digest(folder: Path) -> str:
    """sha256 over a folder's files (relative names and bytes, sorted)."""
    h = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        h.update(path.relative_to(folder).as_posix().encode() + b"\0")
        with path.open("rb") as fh:
            h.update(hashlib.file_digest(fh, "sha256").digest())
    return h.hexdigest()


def resolve_model(model: str, revision: str | None, models_dir: Path) -> tuple[str, str | None]:
    """``(what from_pretrained loads, the revision captions are keyed on)`` for a ``recaption.model``."""
    if model == BUILD:
        path = models_dir / BUILT_CAPTIONER
        if not (path / "config.json").is_file():
            raise InputError(
                f"recaption.model is 'build' but {path} holds no captioner: set models.captioner_build and "
                "re-run prepare_models, or name a hub id / local folder"
            )
        return str(path), f"sha256:{folder_digest(path)}"
    if Path(model).is_dir():
        return model, revision or f"sha256:{folder_digest(Path(model))}"
    if revision is None:
        log.warning("recaption.model %s has no revision: captions are keyed on 'main', which can move", model)
    return model, revision


def recaption_fingerprint(rec: Recaption, model: str, revision: str | None, shorten_revision: str | None) -> str:
    """The settings every caption of a run is keyed on (batch size and device excluded: they do not change it)."""
    generation = {**rec.generation, "dtype": rec.dtype, "backend": rec.backend, "max_tokens": rec.max_tokens}
    if rec.shorten:
        generation["shorten"] = {**rec.shorten.model_dump(), "revision": shorten_revision}
    return settings_fingerprint(model, revision, rec.prompt, generation)


def resolve_device(device: str) -> str:
    """``auto`` → ``cuda`` when available, else ``cpu``."""
    import torch  # lazy: ~2 s to import; caption_images imports this module also for sources it does not caption

    return ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device


def transformers_generate(rec: Recaption, model: str, revision: str | None) -> Callable[[Sequence[np.ndarray]], list]:
    """A batched generate over ``model``, loaded on the first call (a run with nothing to caption loads nothing)."""
    loaded: list = []

    def run(images: Sequence[np.ndarray]) -> list[str]:
        if not loaded:
            loaded.extend(load_captioner(model, revision, rec.dtype, resolve_device(rec.device)))
            log.info("captioner %s (revision %s) loaded on %s", model, revision, loaded[1].device)
        return generate(*loaded, images, rec.prompt, rec.generation)

    return run


def vllm_generate(rec: Recaption, model: str, revision: str | None) -> Callable[[Sequence[np.ndarray]], list]:
    """The same captioner served by vLLM (greedy: temperature 0), loaded on the first call.

    Unmeasured here (no GPU, vLLM not installed on the development machines); the request format is vLLM's
    multi-modal ``{"prompt", "multi_modal_data": {"image": PIL}}``."""
    try:
        # optional dependency, CUDA only: imported when the backend is chosen
        from vllm import LLM, SamplingParams
    except ImportError:
        raise InputError("recaption.backend is 'vllm' but vllm is not installed: pip install vllm") from None
    from PIL import Image  # vLLM's multi-modal inputs are PIL images

    loaded: list = []
    sampling = SamplingParams(temperature=0.0, max_tokens=int(rec.generation.get("max_new_tokens", 40)))

    def run(images: Sequence[np.ndarray]) -> list[str]:
        if not loaded:
            loaded.append(LLM(model=model, revision=revision, dtype={"fp32": "float32"}.get(rec.dtype, rec.dtype)))
        requests = [{"prompt": rec.prompt, "multi_modal_data": {"image": Image.fromarray(im)}} for im in images]
        return [out.outputs[0].text.strip() for out in loaded[0].generate(requests, sampling)]

    return run


def load_shortener(shorten: Shorten, device: str):
    """``(tokenizer, model)`` of the shortening pass: a causal LM, else a sequence-to-sequence one."""
    # transformers' auto classes import every family's config: only the captioning stage needs them
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoTokenizer

    config = AutoConfig.from_pretrained(shorten.model, revision=shorten.revision)
    auto = AutoModelForSeq2SeqLM if config.is_encoder_decoder else AutoModelForCausalLM
    tokenizer = AutoTokenizer.from_pretrained(shorten.model, revision=shorten.revision)
    model = auto.from_pretrained(shorten.model, revision=shorten.revision).to(device).eval()
    return tokenizer, model


def shorten_texts(tokenizer, model, captions: Sequence[str], shorten: Shorten) -> list[str]:
    """Each caption rewritten by the text model (greedy), only the new text kept."""
    prompts = [shorten.prompt.replace("{caption}", c) for c in captions]
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"  # decoder-only models continue the last position
    import torch  # lazy: see resolve_device

    inputs = tokenizer(prompts, return_tensors="pt", padding=True).to(model.device)
    with torch.inference_mode():
        out = model.generate(**inputs, **shorten.generation, pad_token_id=tokenizer.pad_token_id)
    if not model.config.is_encoder_decoder:
        out = out[:, inputs["input_ids"].shape[1] :]
    return [t.strip() for t in tokenizer.batch_decode(out, skip_special_tokens=True)]


def with_shortening(first: Callable, shorten: Shorten, device: str) -> Callable[[Sequence[np.ndarray]], list]:
    """``first``'s captions passed through the shortening model (loaded on the first call); an empty first
    caption stays empty (the judge rejects it)."""
    loaded: list = []

    def run(images: Sequence[np.ndarray]) -> list[str]:
        captions = first(images)
        if not loaded:
            loaded.extend(load_shortener(shorten, resolve_device(device)))
        todo = [i for i, c in enumerate(captions) if c.strip()]
        short = shorten_texts(*loaded, [captions[i] for i in todo], shorten) if todo else []
        for i, text in zip(todo, short, strict=True):
            captions[i] = text
        return captions

    return run


def captioner_for(rec: Recaption, model: str, revision: str | None) -> Callable[[Sequence[np.ndarray]], list]:
    """The run's batched generate: the backend's, then the shortening pass if one is set."""
    first = (vllm_generate if rec.backend == "vllm" else transformers_generate)(rec, model, revision)
    return with_shortening(first, rec.shorten, rec.device) if rec.shorten else first
