"""Synthetic captions (issue 26, in progress): what a captioning stage decides, as pure functions.

- :mod:`~sdforge.captions.cache`: a caption's content key — (image sha256, model, revision, prompt, generation
  settings) — so adding shards captions only new images and any change of model or prompt recaptions everything.
- :mod:`~sdforge.captions.quality`: degenerate generations (empty, repetitive, the prompt echoed, over the length
  cap) are named, and the original caption is kept for them.
- :mod:`~sdforge.captions.mix`: which caption a sample trains with in an epoch, a pure function of
  (seed, sample key, epoch), so exact resume and DDP equivalence hold.
- :mod:`~sdforge.captions.captioner`: a vision-language model from ``from_pretrained`` (hub id or local folder),
  batched deterministic generation, its output judged.
- :mod:`~sdforge.captions.shards`: a fetched source's tars → one parquet of captions per shard, resumable, reusing
  earlier captions made with the same settings.

Not built yet: the DVC stage ``caption_images@<source>`` and its params (``sources.<s>.recaption``), the encode
stage storing token ids for both captions, the loader's per-phase ``caption_mix``, the optional shortening pass and
vLLM backend, MLflow tables, the demo captioner and ``bench/caption.py``.
"""
