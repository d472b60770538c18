"""MLflow tracking for stages: one parent run per phase (or ``data``, ``models``, ``report``), a child run
per stage.

The tracking URI is ``MLFLOW_TRACKING_URI`` when set (a server, in the full stack), else
``tracking.mlflow_uri`` from params (a git-ignored SQLite file by default).

The parent run is what a user opens first, so it summarises its children (:func:`summarise`): each stage
copies its headline figures onto it as ``<stage>.<metric>`` (``train.final_loss``,
``filter_metadata.laion.rows_out``), its key artifacts (the eval grid), and a markdown section of the run's
description (``mlflow.note.content``, sections ordered as the DAG). The phase's own params go on the parent
too (``parent_params``); MLflow params cannot change, so a stage whose parent params differ from the newest
parent run's (the phase was reconfigured and rerun) starts a new parent run of the same name and leaves
the old one as history. The experiment is tagged as model training (``mlflow.experimentKind``), so MLflow
3's UI opens its runs table rather than the GenAI view.

Short stages that log only at their end open their run with ``deferrable=True``: with a local SQLite store
(and ``tracking.spool``) their records are spooled and replayed by the next process that opens MLflow
(:mod:`sdforge.tracking_spool`, :func:`flush_spool`), which saves each of them MLflow's ~4-s start-up.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from sdforge.config import Tracking, redact_credentials
from sdforge.io import OutputError
from sdforge.tracking_spool import SpooledRun, locked, pending, set_aside, spool_dir, staged_files

log = logging.getLogger(__name__)

PARENT_TAG = "sdforge.parent"
SOURCE_TAG = "mlflow.source.name"
"""The program that logged a run (MLflow sets it; a replayed run keeps its stage's, not the replayer's)."""
SPOOLED_TAG = "sdforge.spooled_ms"
"""On a run replayed from the spool: when its stage recorded it (ms since the epoch)."""
STAGE_TAG = "sdforge.stage"
MLFLOW_PARENT_TAG = "mlflow.parentRunId"
NOTE_TAG = "mlflow.note.content"
"""A run's description (markdown) in the MLflow UI."""
NOTE_SECTION = re.compile(r"<!-- sdforge:(\S+) -->\n")
"""Opens each stage's section of a parent's description, ``<!-- sdforge:<NN>.<stage>[.<item>] -->`` (NN: the
stage's DAG position): invisible in the rendered markdown, it lets a stage replace its own section."""
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
MODEL_TRAINING = "custom_model_development"
"""The experiment kind whose MLflow 3 UI opens on the runs table (untagged, it opens the GenAI view)."""
STAGE_ORDER = (
    "make_demo_data",
    "download_metadata",
    "filter_metadata",
    "fetch_images",
    "prepare_models",
    "caption_images",
    "encode_latents",
    "condition_images",
    "mix_phase",
    "train",
    "eval_grid",
    "report",
)
MAX_TAG_CHARS = 8000
"""MLflow's limit on a tag value (a longer description is cut)."""

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


MODEL_TRAINING_VIEW = "?workflowType=machine_learning"
"""MLflow 3.17's UI opens every page in its GenAI view unless the URL (or the user's sidebar switch) asks for
model training; the experiment's kind tag alone does not change that."""


def ui_route(experiment_id: str, run_id: str | None = None, artifact: str | None = None) -> str:
    """The MLflow UI's route (after its address) to an experiment's runs table, a run's overview (params,
    metrics, description) or one of its artifacts, in the model-training view."""
    route = f"/#/experiments/{experiment_id}"
    if run_id:
        route += f"/runs/{run_id}" + (f"/artifacts/{artifact}" if artifact else "")
    return route + MODEL_TRAINING_VIEW


def experiment_url(cfg: Tracking, experiment_id: str) -> str:
    """The MLflow UI page of an experiment: its runs table."""
    return ui_base(cfg) + ui_route(experiment_id)


def run_url(cfg: Tracking, experiment_id: str, run_id: str) -> str:
    """The MLflow UI page of one run (overview: params, metrics, description)."""
    return ui_base(cfg) + ui_route(experiment_id, run_id)


def newest_parent(client: Any, experiment_id: str, parent: str) -> Any | None:
    """The newest (not deleted) parent run named ``parent`` (a phase, ``data``, ``models``, ``report``), or None."""
    runs = client.search_runs(
        [experiment_id],
        filter_string=f"tags.`{PARENT_TAG}` = '{parent}' and attributes.status != 'DELETED'",
        order_by=["attributes.start_time DESC"],
        max_results=1,
    )
    return runs[0] if runs else None


def _parent_run_id(client: Any, experiment_id: str, parent: str, parent_params: dict[str, str], stage: str = "") -> str:
    """The newest parent run named ``parent`` whose params agree with ``parent_params`` (which it then
    carries), or a new one when there is none or they differ. A new one replacing a changed run starts with
    the summary of the stages before ``stage`` in the DAG (they did not rerun: ``stage`` and later will)."""
    newest = newest_parent(client, experiment_id, parent)
    runs = [newest] if newest else []
    logged = runs[0].data.params if runs else {}
    changed = sorted(k for k, v in parent_params.items() if k in logged and logged[k] != v)
    if runs and not changed:
        run_id = runs[0].info.run_id
    else:
        if changed:
            log.info("%s: params %s changed since run %s: a new parent run", parent, changed, runs[0].info.run_id)
        run = client.create_run(experiment_id, run_name=parent, tags={PARENT_TAG: parent})
        client.set_terminated(run.info.run_id)
        if changed:
            _carry_summary(client, runs[0], run.info.run_id, _stage_rank(stage))
        run_id, logged = run.info.run_id, {}
    missing = [(k, v) for k, v in parent_params.items() if k not in logged]
    if missing:
        # lazy: mlflow (~2 s) is imported only when tracking is on
        from mlflow.entities import Param

        for i in range(0, len(missing), 100):  # MLflow takes at most 100 params per batch
            client.log_batch(run_id, params=[Param(k, v) for k, v in missing[i : i + 100]])
    return run_id


def _carry_summary(client: Any, old: Any, new_id: str, before_rank: int) -> None:
    """Copy onto ``new_id`` the headline metrics and description sections of ``old``'s stages that come
    before ``before_rank`` in :data:`STAGE_ORDER`."""
    # lazy: mlflow (~2 s) is imported only when tracking is on
    from mlflow.entities import Metric

    earlier = [
        Metric(key, value, old.info.start_time, 0)
        for key, value in old.data.metrics.items()
        if _stage_rank(key.split(".", 1)[0]) < before_rank
    ]
    for i in range(0, len(earlier), 1000):  # MLflow takes at most 1000 metrics per batch
        client.log_batch(new_id, metrics=earlier[i : i + 1000])
    note = old.data.tags.get(NOTE_TAG, "")
    parts = NOTE_SECTION.split(note)
    for key, text in zip(parts[1::2], parts[2::2], strict=True):
        if int(key.split(".", 1)[0]) < before_rank:
            note_now = client.get_run(new_id).data.tags.get(NOTE_TAG, "")
            client.set_tag(new_id, NOTE_TAG, with_section(note_now, key, text))


def _model_training_experiment(mlflow: Any, name: str) -> Any:
    """``mlflow.set_experiment(name)``, tagged as model training the first time."""
    experiment = mlflow.set_experiment(name)
    if experiment.tags.get(EXPERIMENT_KIND_TAG) != MODEL_TRAINING:
        mlflow.MlflowClient().set_experiment_tag(experiment.experiment_id, EXPERIMENT_KIND_TAG, MODEL_TRAINING)
    return experiment


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
    log_text = log_dict = log_image = log_figure = log_artifact = log_artifacts = log_table = _drop
    set_tag = set_tags = _drop

    def active_run(self) -> None:
        """No run is active when tracking is off."""
        return None


NULL_TRACKING = NullTracking()


@contextlib.contextmanager
def stage_run(
    cfg: Tracking,
    parent: str,
    stage: str,
    params: dict[str, Any] | None = None,
    parent_params: dict[str, Any] | None = None,
    *,
    deferrable: bool = False,
) -> Iterator[Any]:
    """Open an MLflow child run named ``stage`` under the parent run ``parent``.

    ``parent_params`` (e.g. the phase's config) are logged on the parent run (see the module docstring for
    what happens when they changed). Yields the ``mlflow`` module with the run active, so callers use
    ``mlflow.log_metric`` and :func:`summarise`; with ``tracking.enabled: false`` it yields
    :data:`NULL_TRACKING` and never imports mlflow. ``deferrable`` (a stage that logs nothing a user watches
    live): with a local SQLite store and ``tracking.spool`` it yields a :class:`SpooledRun` that records the
    calls for a later replay, and mlflow is not imported. A direct run first replays what is spooled.
    """
    if not cfg.enabled:
        log.info("tracking.enabled is false: %s/%s logs nothing to MLflow", parent, stage)
        yield NULL_TRACKING
        return
    uri = tracking_uri(cfg)
    spool = spool_dir(uri) if deferrable and cfg.spool else None
    if spool is not None:
        yield from _spooled_run(spool, parent, stage, flatten(params or {}), flatten(parent_params or {}))
        return
    # lazy: mlflow (~2 s); flows and tests import this module without logging
    import mlflow

    with _env_untouched("MLFLOW_TRACKING_URI"):  # mlflow.set_tracking_uri also exports it to the env
        mlflow.set_tracking_uri(uri)
        experiment = _model_training_experiment(mlflow, cfg.experiment)
        _replay_spool(mlflow, experiment.experiment_id, spool_dir(uri))
        with _child_run(mlflow, experiment.experiment_id, parent, stage, flatten(params or {}),
                        flatten(parent_params or {})) as run:  # fmt: skip
            log.info("MLflow run %s (%s/%s) at %s", run.info.run_id, parent, stage, redact_credentials(uri))
            yield mlflow


def _spooled_run(spool: Path, parent: str, stage: str, params: dict, parent_params: dict) -> Iterator[SpooledRun]:
    """Yield a recorder for ``parent``/``stage`` and put what it recorded in ``spool`` (FAILED if it raised)."""
    recorder = SpooledRun(parent, stage, params, parent_params)
    try:
        yield recorder
    except BaseException:
        recorder.failed()
        _spool_failed(recorder, spool)  # the stage's own error goes on, not a spool write fault after it
        raise
    entry = recorder.write(spool)
    log.info("MLflow run of %s/%s spooled to %s (replayed when a stage next opens MLflow, or by "
             "`sdforge tracking-flush`)", parent, stage, entry)  # fmt: skip


def _spool_failed(recorder: SpooledRun, spool: Path) -> None:
    """Spool the run of a stage that raised; a write fault here is only logged (the stage's error is the one)."""
    try:
        recorder.write(spool)
    except OutputError as err:
        log.error("%s", err)


@contextlib.contextmanager
def _child_run(
    mlflow: Any, experiment_id: str, parent: str, stage: str, params: dict, parent_params: dict, tags=None
):
    """The active child run ``stage`` under the parent run ``parent`` (flat ``params``, ``parent_params``;
    ``tags`` over MLflow's own, such as the source a replayed run came from)."""
    parent_id = _parent_run_id(mlflow.MlflowClient(), experiment_id, parent, parent_params, stage)
    with mlflow.start_run(run_id=parent_id):
        with mlflow.start_run(run_name=stage, nested=True, tags={STAGE_TAG: stage, **(tags or {})}) as run:
            if params:
                mlflow.log_params(params)
            yield run


def flush_spool(cfg: Tracking, uri: str | None = None) -> int:
    """Replay the spooled runs of ``uri`` (default: the tracking URI in force) into MLflow, oldest first;
    returns how many. Cheap (mlflow not imported) when nothing is spooled."""
    uri = uri or tracking_uri(cfg)
    spool = spool_dir(uri)
    if not cfg.enabled or spool is None or not pending(spool):
        return 0
    # lazy: mlflow (~2 s), only when something is spooled
    import mlflow

    with _env_untouched("MLFLOW_TRACKING_URI"):
        mlflow.set_tracking_uri(uri)
        return _replay_spool(mlflow, _model_training_experiment(mlflow, cfg.experiment).experiment_id, spool)


def _replay_spool(mlflow: Any, experiment_id: str, spool: Path | None) -> int:
    """Replay every spooled run under ``spool``'s lock, each then removed (set aside, with a warning, if its
    replay raised); the number replayed."""
    if spool is None or not pending(spool):
        return 0
    done = 0
    with locked(spool):
        for entry in pending(spool):  # listed under the lock: another process may have replayed some
            try:
                _replay(mlflow, experiment_id, entry)
            except Exception as err:  # noqa: BLE001 - one bad entry must not block the others or the stage
                log.warning("could not replay the spooled MLflow run %s (%s): moved to %s", entry, err,
                            set_aside(entry))  # fmt: skip
                continue
            shutil.rmtree(entry)
            done += 1
    log.info("replayed %d spooled MLflow run(s) from %s", done, spool)
    return done


def _replay(mlflow: Any, experiment_id: str, entry: Path) -> None:
    """Log one spooled run as the direct run would have been logged."""
    spec = json.loads((entry / "entry.json").read_text())
    tags = {SPOOLED_TAG: str(spec["recorded_ms"])} | ({SOURCE_TAG: spec["source"]} if spec.get("source") else {})
    with tempfile.TemporaryDirectory() as tmp:
        with _child_run(mlflow, experiment_id, spec["parent"], spec["stage"], spec["params"],
                        spec["parent_params"], tags) as run:  # fmt: skip
            for i, call in enumerate(spec["calls"]):
                _replay_call(mlflow, entry, call, Path(tmp) / str(i))
        if spec["status"] != "FINISHED":
            mlflow.MlflowClient().set_terminated(run.info.run_id, spec["status"])


def _replay_call(mlflow: Any, entry: Path, call: dict, tmp: Path) -> None:
    """Re-issue one recorded call (:class:`SpooledRun`) against the active run."""
    name = call["call"]
    if name == "log_metrics":
        mlflow.log_metrics(call["metrics"], step=call["step"])
    elif name == "log_params":
        mlflow.log_params(call["params"])
    elif name == "set_tags":
        mlflow.set_tags(call["tags"])
    elif name == "artifact":
        artifact_dir, _, file_name = call["artifact_file"].rpartition("/")
        target = tmp / file_name
        tmp.mkdir(parents=True)
        shutil.copyfile(entry / call["file"], target)
        mlflow.log_artifact(str(target), artifact_dir or None)
    elif name == "summarise":
        files = staged_files(entry, call["files"], tmp)
        summarise(mlflow, metrics=call["metrics"], note=call["note"], artifacts=files, step=call["step"])
    else:
        raise ValueError(f"unknown spooled call {name!r}")


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


def numeric(metrics: dict[str, Any], keys: Iterable[str] | None = None) -> dict[str, float]:
    """The numeric values of ``metrics`` (only ``keys`` when given; bools and missing keys are left out)."""
    wanted = metrics if keys is None else {k: metrics[k] for k in keys if k in metrics}
    return {k: float(v) for k, v in wanted.items() if isinstance(v, int | float) and not isinstance(v, bool)}


def log_stage(
    cfg: Tracking,
    parent: str,
    stage: str,
    metrics: dict[str, Any],
    params: dict[str, Any] | None = None,
    *,
    headline: Iterable[str] = (),
    note: str | None = None,
):
    """Log a finished stage's params, numeric metrics and metrics JSON as one MLflow child run; copy the
    ``headline`` metrics and the ``note`` (a markdown section) onto the parent run (:func:`summarise`).
    All of it is known at the stage's end, so the run is deferrable (spooled with a SQLite store)."""
    with stage_run(cfg, parent, stage, params, deferrable=True) as mlflow:
        mlflow.log_metrics(numeric(metrics))
        text = redact_credentials(json.dumps(metrics, indent=2, sort_keys=True, default=str))
        mlflow.log_text(text, f"{stage.split('@')[0]}.json")
        summarise(mlflow, metrics=numeric(metrics, headline), note=note)


def summarise(
    mlflow: Any,
    *,
    metrics: dict[str, float] | None = None,
    note: str | None = None,
    artifacts: Iterable[tuple[Path, str | None]] = (),
    step: int = 0,
) -> None:
    """Copy what a user should see first onto the active stage run's parent run: ``metrics`` as
    ``<stage>.<name>`` (``@`` in the stage becomes ``.``), ``artifacts`` (``(local file or dir, artifact
    dir)`` pairs) and ``note``, this stage's section of the parent's description. Does nothing when
    tracking is off; recorded for the replay in a spooled run."""
    if isinstance(mlflow, SpooledRun):
        mlflow.record_summary(metrics, note, artifacts, step)
        return
    run = mlflow.active_run()
    if run is None:
        return
    parent_id, stage = run.data.tags[MLFLOW_PARENT_TAG], run.data.tags[STAGE_TAG]
    client, prefix = mlflow.MlflowClient(), stage.replace("@", ".")  # MLflow keys allow no "@"
    if metrics:
        # lazy: mlflow (~2 s) is imported only when tracking is on
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        client.log_batch(parent_id, metrics=[Metric(f"{prefix}.{k}", float(v), now, step) for k, v in metrics.items()])
    for path, artifact_path in artifacts:
        log_one = client.log_artifacts if Path(path).is_dir() else client.log_artifact
        log_one(parent_id, str(path), artifact_path)
    if note is not None:
        current = client.get_run(parent_id).data.tags.get(NOTE_TAG, "")
        client.set_tag(parent_id, NOTE_TAG, with_section(current, f"{_stage_rank(stage):02d}.{prefix}", note))


def with_section(note: str, key: str, text: str) -> str:
    """``note`` with its section ``key`` set to ``text`` (added or replaced), sections ordered by key; cut to
    MLflow's tag limit. Text before the first section marker (a user's own words) is kept first."""
    parts = NOTE_SECTION.split(note)
    head, sections = parts[0].strip(), dict(zip(parts[1::2], (p.strip() for p in parts[2::2]), strict=True))
    sections[key] = text.strip()
    body = "\n\n".join(f"<!-- sdforge:{k} -->\n{v}" for k, v in sorted(sections.items()))
    return (f"{head}\n\n{body}" if head else body)[:MAX_TAG_CHARS]


def _stage_rank(stage: str) -> int:
    """The stage's place in :data:`STAGE_ORDER` (unknown stages last)."""
    name = stage.split("@", 1)[0]
    return STAGE_ORDER.index(name) if name in STAGE_ORDER else len(STAGE_ORDER)
