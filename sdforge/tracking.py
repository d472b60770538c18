"""MLflow tracking for stages: one parent run per phase (or ``data``), a child run per stage.

The tracking URI is ``MLFLOW_TRACKING_URI`` when set (a server, in the full stack), else
``tracking.mlflow_uri`` from params (a git-ignored SQLite file by default).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterator
from typing import Any

from sdforge.config import Tracking, redact_credentials

log = logging.getLogger(__name__)

PARENT_TAG = "sdforge.parent"
STAGE_TAG = "sdforge.stage"

# Keys whose values never go to MLflow (credentials in params or env must not leak): logged as REDACTED.
_SECRET_MARKERS = (
    "secret",
    "password",
    "passwd",
    "token",
    "credential",
    "access_key",
    "api_key",
    "apikey",
    "private_key",
)
REDACTED = "***"
MAX_PARAM_CHARS = 6000
"""MLflow's limit on a param value (longer values are cut)."""


def tracking_uri(cfg: Tracking) -> str:
    """The MLflow tracking URI in force."""
    return os.environ.get("MLFLOW_TRACKING_URI") or cfg.mlflow_uri


def ui_base(cfg: Tracking) -> str:
    """The MLflow UI's address: the tracking URI when it is a server, else ``tracking.ui_url``."""
    uri = tracking_uri(cfg)
    return (uri if uri.startswith(("http://", "https://")) else cfg.ui_url).rstrip("/")


def run_url(cfg: Tracking, experiment_id: str, run_id: str) -> str:
    """The MLflow UI page of one run."""
    return f"{ui_base(cfg)}/#/experiments/{experiment_id}/runs/{run_id}"


def _parent_run_id(client: Any, experiment_id: str, parent: str) -> str:
    runs = client.search_runs(
        [experiment_id],
        filter_string=f"tags.`{PARENT_TAG}` = '{parent}' and attributes.status != 'DELETED'",
        order_by=["attributes.start_time DESC"],
        max_results=1,
    )
    if runs:
        return runs[0].info.run_id
    run = client.create_run(experiment_id, run_name=parent, tags={PARENT_TAG: parent})
    client.set_terminated(run.info.run_id)
    return run.info.run_id


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """Flatten nested dicts to dotted keys and string values, as MLflow params, with secrets redacted: the
    value of a key naming a secret (``*secret*``, ``*token*``, ``*password*`` ...) is ``***``, and so is the
    userinfo of any URL in a value (``s3://***@bucket``). Values are cut to MLflow's limit after redaction."""
    out: dict[str, str] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if any(m in key.lower() for m in _SECRET_MARKERS):
            out[key] = REDACTED
        elif isinstance(v, dict):
            out.update(flatten(v, f"{key}."))
        else:
            out[key] = redact_credentials(str(v))[:MAX_PARAM_CHARS]
    return out


class NullTracking:
    """Stands in for the ``mlflow`` module when tracking is off: every logging call does nothing."""

    def _drop(self, *args: Any, **kwargs: Any) -> None:
        return None

    log_metric = log_metrics = log_param = log_params = _drop
    log_text = log_dict = log_image = log_figure = log_artifact = log_artifacts = _drop
    set_tag = set_tags = _drop

    def active_run(self) -> None:
        """No run is active when tracking is off."""
        return None


NULL_TRACKING = NullTracking()


@contextlib.contextmanager
def stage_run(cfg: Tracking, parent: str, stage: str, params: dict[str, Any] | None = None) -> Iterator[Any]:
    """Open an MLflow child run named ``stage`` under the parent run ``parent``.

    Yields the ``mlflow`` module with the run active, so callers use ``mlflow.log_metric`` etc.;
    with ``tracking.enabled: false`` it yields :data:`NULL_TRACKING` and never imports mlflow.
    """
    if not cfg.enabled:
        log.info("tracking.enabled is false: %s/%s logs nothing to MLflow", parent, stage)
        yield NULL_TRACKING
        return
    # lazy: mlflow (~2 s); flows and tests import this module without logging
    import mlflow

    uri = tracking_uri(cfg)
    with _env_untouched("MLFLOW_TRACKING_URI"):  # mlflow.set_tracking_uri also exports it to the env
        mlflow.set_tracking_uri(uri)
        experiment = mlflow.set_experiment(cfg.experiment)
        client = mlflow.MlflowClient()
        parent_id = _parent_run_id(client, experiment.experiment_id, parent)
        with mlflow.start_run(run_id=parent_id):
            with mlflow.start_run(run_name=stage, nested=True, tags={STAGE_TAG: stage}) as run:
                if params:
                    mlflow.log_params(flatten(params))
                log.info("MLflow run %s (%s/%s) at %s", run.info.run_id, parent, stage, redact_credentials(uri))
                yield mlflow


@contextlib.contextmanager
def _env_untouched(name: str) -> Iterator[None]:
    """Restore environment variable ``name`` on exit: a stage must not redirect later stages' tracking."""
    before = os.environ.get(name)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def log_stage(cfg: Tracking, parent: str, stage: str, metrics: dict[str, Any], params: dict[str, Any] | None = None):
    """Log a finished stage's params, numeric metrics and metrics JSON as one MLflow child run."""
    with stage_run(cfg, parent, stage, params) as mlflow:
        mlflow.log_metrics({k: float(v) for k, v in metrics.items() if isinstance(v, int | float)})
        text = redact_credentials(json.dumps(metrics, indent=2, sort_keys=True, default=str))
        mlflow.log_text(text, f"{stage.split('@')[0]}.json")
