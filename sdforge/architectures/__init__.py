"""The real architectures of the full-scale frozen models, buildable without downloading weights.

``sdforge preflight`` (issue 15) checks the full-scale configuration on a machine that has no network and
no Hugging Face cache. With ``models.missing_weights: random``, ``prepare_models`` builds the VAE and CLIP
text encoder from the configs here with seeded random weights, and CLIP's real tokenizer from the BPE
merges file that the ``open-clip-torch`` wheel ships. Never for a real run: random frozen models make
meaningless latents and text embeddings.

Decisions a later engineer must know:

* ``configs/<owner>--<name>.json`` is keyed by hub id (``/`` → ``--``). A file is either a diffusers
  ``AutoencoderKL`` config (``"_class_name": "AutoencoderKL"``, as the hub's ``config.json``) or a
  transformers ``CLIPTextConfig`` (``"model_type": "clip_text_model"``, the ``text_config`` of the hub's
  ``config.json``). To support another hub id, copy its config here; nothing else changes.
* ``stabilityai--sd-vae-ft-mse.json`` is that repo's ``config.json`` plus ``scaling_factor: 0.18215``
  (the old file omits it; diffusers' default is the same value, written out so it cannot drift).
* ``stabilityai--sdxl-vae.json`` (SDXL's VAE: SD's architecture, ``scaling_factor`` 0.13025, ``force_upcast``: it
  overflows fp16) and ``madebyollin--sdxl-vae-fp16-fix.json`` (the same, ``force_upcast: false``) are those repos'
  ``config.json`` fields that shape the model (both MIT; docs/SDXL.md "The VAE's precision").
* ``openai--clip-vit-large-patch14.json`` sets ``bos/eos/pad_token_id`` to 49406/49407/49407 where the
  hub's ``text_config`` says 0/2/1. transformers treats ``eos_token_id == 2`` as legacy and pools at the
  argmax of the input ids; with 49407 it pools at the first ``<|endoftext|>``. For CLIP's vocabulary
  (``<|endoftext|>`` = 49407 is the largest id) both pick the same token, so the outputs are identical.
* The tokenizer's merges come from ``open_clip/bpe_simple_vocab_16e6.txt.gz`` (``open-clip-torch==3.3.0``,
  installed ``--no-deps`` by ``make venv``: its dependencies would pull torchvision). ``open_clip`` is
  located with ``importlib.util.find_spec`` and never imported.
* ``prepare_models`` falls back per component: with ``missing_weights: random`` each of the text encoder,
  tokenizer and VAE is first loaded with ``local_files_only=True`` (a local folder or the HF cache) and only
  a missing one is built here (metrics ``vae_weights`` / ``text_encoder_weights``). transformers 5's
  ``CLIPTokenizer.from_pretrained`` returns a 2-token placeholder instead of raising when there are no files:
  the stage treats a tokenizer under 256 tokens as missing. With ``missing_weights: error`` (the default)
  a failed ``from_pretrained`` is re-raised as a ``ConfigError`` naming ``models.<key>`` and the id.
"""

from sdforge.architectures.clip_tokenizer import (
    OPEN_CLIP_PIN,
    clip_bpe_path,
    clip_bpe_vocab_and_merges,
    write_clip_tokenizer,
)
from sdforge.architectures.frozen import (
    architecture_config,
    build_random_text_encoder,
    build_random_vae,
    known_architectures,
)

__all__ = [
    "OPEN_CLIP_PIN",
    "architecture_config",
    "build_random_text_encoder",
    "build_random_vae",
    "clip_bpe_path",
    "clip_bpe_vocab_and_merges",
    "known_architectures",
    "write_clip_tokenizer",
]
