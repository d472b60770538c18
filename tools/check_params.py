"""``python -m tools.check_params [params.yaml]`` (also ``sdforge check``): validate a params file before DVC reads it.

DVC parses ``params.yaml`` with its own YAML loader before any stage runs, and expands every alias: a 486-byte
alias bomb kept ``dvc repro`` 2 min 5 s at 5.9 GB until it aborted (SIGABRT; DVC 3.67, docs/INPUTS.md). This
loads it through :func:`sdforge.config.load_params` (1 MiB, 1,000,000 expanded values, every source and phase
name checked) in ~0.3 s and exits 2 with one line naming the problem. ``make demo`` runs it before
``dvc repro``; the Prefect flows and the preflight load params the same way before they call DVC.
"""

from __future__ import annotations

import argparse
import logging
import sys

from sdforge.config import ConfigError, load_params
from sdforge.io import setup_logging

log = logging.getLogger(__name__)


def check(path: str) -> int:
    """0 when ``path`` loads and validates (logged with its source and phase counts), else 2 with the error."""
    try:
        params = load_params(path)
    except ConfigError as err:
        log.error("%s", err)
        return 2
    log.info("%s: ok (%d sources, %d phases)", path, len(params.sources), len(params.phases))
    return 0


def main(argv: list[str] | None = None) -> None:
    """CLI entry point."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("params", nargs="?", default="params.yaml")
    setup_logging()
    sys.exit(check(ap.parse_args(argv).params))


if __name__ == "__main__":
    main()
