"""Prefect flows over the DVC pipeline: ordering, retries and parameters only.

DVC decides what is stale and runs the stage commands; the flows pick which stages to
ask for, in what order, and with which retry policy. No data logic lives here.
"""

import sdforge  # noqa: F401  (first: silences known library messages before any import logs them)
