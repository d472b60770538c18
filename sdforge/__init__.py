"""The sdforge library, by capability: ``config``, ``io``, ``tracking``, ``demo``, ``ingest``, ``latents``,
``training``, ``eval``.

Built on ``model/`` (pure torch); used by ``stages/`` (the DVC stages). See ``docs/ARCHITECTURE.md``.
"""

from sdforge.library_logs import silence_known_messages

silence_known_messages()  # before any third-party import can log them (sdforge/library_logs.py)
