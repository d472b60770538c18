"""Synthetic captions (docs/CAPTIONS.md): what the ``caption_images`` stage and a phase's ``caption_mix`` decide.

- :mod:`~sdforge.captions.cache`: a caption's content key — (image sha256, model, revision, prompt, generation
  settings) — so adding shards captions only new images and any change of model or prompt recaptions everything.
- :mod:`~sdforge.captions.quality`: degenerate generations (empty, repetitive, the prompt echoed, over the length
  cap) are named, and the original caption is kept for them.
- :mod:`~sdforge.captions.mix`: which caption a sample trains with in an epoch, a pure function of
  (seed, sample, epoch), so exact resume and DDP equivalence hold.
- :mod:`~sdforge.captions.captioner`: a vision-language model from ``from_pretrained`` (hub id or local folder),
  batched deterministic generation, its output judged.
- :mod:`~sdforge.captions.models`: what a ``recaption`` section names (``build``, a folder, a hub id), the settings
  fingerprint, the transformers and vLLM backends and the shortening pass.
- :mod:`~sdforge.captions.shards`: a fetched source's tars → one parquet of captions per shard, resumable, reusing
  earlier captions made with the same settings; :mod:`~sdforge.captions.store` is that parquet's format.
- :mod:`~sdforge.captions.report`: counts, token lengths and the sampled-images table for metrics and MLflow.
"""
