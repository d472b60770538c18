"""Bounds on what a data file may cost a stage, applied before the bytes reach a parser or native code.

Every place data enters a stage, or a stage re-reads another stage's output, goes through one of these (the list,
with each entry point's bound: docs/INPUTS.md):

- :mod:`~sdforge.bounds.json_docs`: JSON documents from data files (nesting depth, size, entry count;
  ``sources.<s>.inputs``).
- :mod:`~sdforge.bounds.archives`: compressed side files (inflated size and ratio).
- :mod:`~sdforge.bounds.images`: image headers before any pixel is decoded (``fetch.max_image_pixels``).
- :mod:`~sdforge.bounds.captions`: captions cut before a tokenizer sees them (``fetch.max_caption_chars``).
- :mod:`~sdforge.bounds.paths`: symlinks that loop or leave their folder.
"""
