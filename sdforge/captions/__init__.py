"""Synthetic captions (issue 26, in progress): what a captioning stage decides, as pure functions.

- :mod:`~sdforge.captions.cache`: a caption's content key — (image sha256, model, revision, prompt, generation
  settings) — so adding shards captions only new images and any change of model or prompt recaptions everything.
- :mod:`~sdforge.captions.quality`: degenerate generations (empty, repetitive, the prompt echoed, over the length
  cap) are named, and the original caption is kept for them.
- :mod:`~sdforge.captions.mix`: which caption a sample trains with in an epoch, a pure function of
  (seed, sample key, epoch), so exact resume and DDP equivalence hold.

The stage itself (``caption_images``: model loading, batched generation, per-shard parquet, DVC wiring) is not
built yet.
"""
