"""Where the pipeline's files live: ``paths`` (local folders), ``tracking`` (MLflow) and ``storage`` (S3)."""

from __future__ import annotations

from pydantic import field_validator

from sdforge.config.base import S3Url, SafeName, Section, Url


class Paths(Section):
    """Every on-disk location of the pipeline (relative to the repo root)."""

    demo_source: str
    metadata: str
    filtered: str
    shards: str
    captions: str
    latents: str
    conditions: str = "data/conditions"
    """``<source>/<resolution>/<kind>/``: the conditioning images of ControlNet phases (``condition_images``)."""
    models: str
    mixes: str
    checkpoints: str
    runs: str
    eval: str
    metrics: str
    evaluations: str = "evaluations"
    """``sdforge evaluate``'s results: ``<phase>/coco-<samples>.json`` (outside every DVC stage's outputs)."""

    @field_validator("*")
    @classmethod
    def _usable_as_a_path(cls, value: str) -> str:
        if not value or "\x00" in value:
            raise ValueError(f"not usable as a folder path (empty, or holds a NUL byte): {value!r}")
        return value


class Tracking(Section):
    """MLflow: tracking URI (overridden by ``MLFLOW_TRACKING_URI``) and experiment."""

    enabled: bool = True
    """``false``: stages log nothing to MLflow (their metrics JSON and logs are unchanged); for machines
    without MLflow, such as a bare GPU pod running ``bench/gpu/run.sh``, and throwaway smoke runs."""
    mlflow_uri: Url = "sqlite:///mlflow.db"
    experiment: str = "sdforge"
    ui_url: Url = "http://127.0.0.1:5000"
    """Where a user opens the MLflow UI when ``mlflow_uri`` is not a server (``make mlflow-ui`` serves the
    SQLite store there): the base of the run links in Prefect artifacts and ``tools.results``. With an
    ``http(s)`` tracking URI the links use that URI instead."""
    spool: bool = True
    """With a local SQLite store, short stages that log only at their end (data, mix, models, encode, a skipped
    eval grid) spool their MLflow records and the next stage that opens MLflow replays them (each saves ~4 s
    of MLflow start-up; :mod:`sdforge.tracking_spool`). ``false``: every stage logs directly. A tracking
    server (``http(s)://``) is always logged to directly."""


class Storage(Section):
    """S3 (or S3-compatible) storage shared by every machine. URLs only: credentials come from the
    standard AWS chain (environment, ~/.aws, the pod's role) and are never written to params or repo.
    Checkpoints go to ``train.checkpoint_s3`` (a param of the train stage)."""

    dvc_remote: S3Url | None = None
    """``s3://bucket/prefix``: the default DVC remote (set in ``.dvc/config.local`` by the flows)."""
    remote_name: SafeName = "storage"
    """The DVC remote's name (a section of ``.dvc/config.local``)."""
    endpoint_url: Url | None = None
    """An S3-compatible endpoint (MinIO, moto, R2) for DVC; boto3 (checkpoints) reads ``AWS_ENDPOINT_URL``."""
    mlflow_artifacts: S3Url | None = None
    """``s3://bucket/prefix``: ``--artifacts-destination`` of the MLflow server ``tools.stack up --mlflow`` starts."""
