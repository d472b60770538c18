"""The sdforge library, by capability: ``config``, ``io``, ``tracking``, ``demo``, ``ingest``, ``latents``,
``training``, ``eval``.

Built on ``model/`` (pure torch); used by ``stages/`` (the DVC stages). See ``docs/ARCHITECTURE.md``.
"""
