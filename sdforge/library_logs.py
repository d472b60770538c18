"""Library log messages this project silences, by message, with the reason for each (issue 55: a normal run of
any ``sdforge`` command or ``make demo`` prints no library warning).

Installed once, when the ``sdforge`` package is first imported; every entry point (``stages/``, ``flows/``,
``tools/``, ``bench/``) imports ``sdforge`` in its package ``__init__`` so that the filter is in place before a
third-party import can emit the message.
"""

from __future__ import annotations

import logging

SILENCED = {
    # transformers 5, on the first use of an image-processor class (diffusers' pipeline module touches the CLIP,
    # SigLIP and BLIP ones at import): "`CLIPImageProcessor` requires torchvision (not installed); falling back to
    # `CLIPImageProcessorPil`". The project installs no torchvision on purpose (PyPI's torchvision does not load
    # beside the pinned CPU torch, and a newer one pulls GBs of CUDA wheels); the PIL processor is the one it
    # wants, and no image processor runs on a hot path (the eval CLIP score and the demo captioner only).
    "transformers.utils.import_utils": "requires torchvision (not installed); falling back to",
}


class DropMessage(logging.Filter):
    """Drops records whose message contains ``fragment``; every other record passes."""

    def __init__(self, fragment: str):
        super().__init__()
        self.fragment = fragment

    def filter(self, record: logging.LogRecord) -> bool:
        return self.fragment not in record.getMessage()


def silence_known_messages() -> None:
    """Add a :class:`DropMessage` filter for each :data:`SILENCED` logger (idempotent)."""
    for name, fragment in SILENCED.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, DropMessage) and f.fragment == fragment for f in logger.filters):
            logger.addFilter(DropMessage(fragment))
