"""The DVC stages, one module per stage of ``dvc.yaml`` (same name): ``run(...)`` does the work and returns
the metrics, ``run_stage(params, item)`` resolves paths and logs to MLflow, ``main()`` is the CLI.
"""

import sdforge  # noqa: F401  (first: silences known library messages before any import logs them)
