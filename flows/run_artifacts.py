"""What a flow run tells about its stages: the Prefect artifacts of ``run_stages`` and their MLflow links.

Keys come from :func:`artifact_key`; ``<target>`` is the flow's target stage(s), e.g. ``eval_grid@phase1``:

- ``stage-<stage>`` (markdown, per finished stage): outcome, seconds, remote status, MLflow run, metrics JSON.
- ``stages-<target>`` (table, when the stage loop ends, whether it succeeded or failed): a row per stage in
  run order with ``stage``, ``outcome`` (one of :data:`OUTCOMES`), ``seconds`` and ``mlflow`` (the URL of
  the stage's MLflow run, or empty).
- ``failure-<target>`` (markdown, on failure only): the failed stage, its exception type and the last
  lines of its error in a fenced block (for ``StageFailed``, the tail of the ``dvc repro`` output).

The table is not repeated as markdown for the sake of its links: Prefect 3's UI renders every string cell
of a table artifact as markdown (``ArtifactDataTable.vue`` of prefect-ui-library; the ``marked`` lexer
with ``gfm: true`` turns a bare URL into a link), so the ``mlflow`` cell is clickable and stays a plain
URL for programs that read the artifact. The Prefect docs do not say so; this was read from the UI
bundled with Prefect 3.9.1 and its markdown worker run on such a cell.

Run links follow ``sdforge.tracking.run_url``: the tracking server's address, or ``tracking.ui_url``
(where ``make mlflow-ui`` serves the SQLite store) when the store is a file.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from prefect import get_run_logger
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from sdforge.config import Tracking
from sdforge.tracking import MLFLOW_PARENT_TAG, PARENT_TAG, STAGE_TAG, flush_spool, run_url, tracking_uri
from sdforge.tracking_spool import SQLITE_PREFIX

OUTCOMES = ("ran", "restored", "skipped", "pulled", "failed", "not run")
"""A stage's outcome in the table: ``ran`` (its command ran), ``restored`` (from DVC's run cache),
``skipped`` (unchanged), ``pulled`` (its outputs came from the DVC remote), ``failed``, ``not run``
(after a failure)."""
TAIL_LINES = 40
"""Lines of a failure's message shown in the failure artifact."""


def artifact_key(prefix: str, stage: str) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes: ``stage-train-phase1``."""
    return f"{prefix}-" + re.sub(r"[^a-z0-9]+", "-", stage.lower()).strip("-")


@dataclass
class StageRow:
    """What happened to one stage in this flow run (a row of the ``stages-<target>`` table)."""

    stage: str
    outcome: str = "not run"
    seconds: float | None = None
    """Wall time of the stage's step (restore, repro, push); for a failed stage, until it failed."""
    mlflow: str = ""


def metrics_path(root: str | Path, metrics_dir: str, stage: str) -> Path:
    """``metrics/<stage>/<item>.json`` for ``stage@item``, ``metrics/<stage>.json`` otherwise."""
    name, _, item = stage.partition("@")
    return Path(root) / metrics_dir / (f"{name}/{item}.json" if item else f"{name}.json")


def store_uri(tracking: Tracking, root: str | Path) -> str | None:
    """The tracking URI, a relative SQLite path resolved against ``root`` (where the stages log); None for a
    SQLite file that does not exist: it holds no runs, and opening it would create it."""
    uri = tracking_uri(tracking)
    if not uri.startswith(SQLITE_PREFIX):
        return uri
    path = Path(root) / uri.removeprefix(SQLITE_PREFIX)  # an absolute path stays itself
    return f"{SQLITE_PREFIX}{path}" if path.is_file() else None


def newest_stage_run(client: Any, experiment: str, stage: str) -> Any | None:
    """The newest MLflow run of ``stage`` in ``experiment``, or None.

    A data stage tags its run ``name@item`` (parent ``data``; ``prepare_models`` has parent ``models``); a
    phase stage tags it ``name`` under the parent run tagged with the phase (``item``).
    """
    found = client.get_experiment_by_name(experiment)
    if found is None:
        return None
    ids = [found.experiment_id]
    name, _, item = stage.partition("@")
    filters = [f"tags.`{STAGE_TAG}` = '{stage}'"]
    if item:
        parents = client.search_runs(ids, f"tags.`{PARENT_TAG}` = '{item}'")
        under = [f"tags.`{MLFLOW_PARENT_TAG}` = '{p.info.run_id}'" for p in parents]
        filters += [f"tags.`{STAGE_TAG}` = '{name}' and {parent}" for parent in under]
    newest = ["attributes.start_time DESC"]
    runs = [r for f in filters for r in client.search_runs(ids, f, order_by=newest, max_results=1)]
    return max(runs, key=lambda r: r.info.start_time, default=None)


def stage_run_url(tracking: Tracking, stage: str, root: str | Path) -> str | None:
    """The MLflow UI page of the newest run of ``stage`` (for a skipped stage, the run that made its outputs).

    None with ``tracking.enabled: false``, without such a run, or on any MLflow error: a link is a
    convenience, and the stage has finished either way.
    """
    uri = store_uri(tracking, root) if tracking.enabled else None
    if uri is None:
        return None
    try:
        flush_spool(tracking, uri)  # a short stage's run may still be spooled (sdforge.tracking_spool)
        # lazy: mlflow (~2 s) only to find a stage's run for its link
        import mlflow

        run = newest_stage_run(mlflow.MlflowClient(uri), tracking.experiment, stage)
    except Exception:  # noqa: BLE001 - see the docstring
        return None
    return run_url(tracking, run.info.experiment_id, run.info.run_id) if run else None


def stage_markdown(stage: str, outcome: dict, restore: str | None, metrics: dict | None, link: str | None) -> str:
    rows = [f"### {stage}", "", f"**{outcome['status']}** in {outcome['seconds']:.1f} s"]
    if restore:
        rows[-1] += f" (remote: {restore})"
    if link:
        rows += ["", f"MLflow run: [{link}]({link})"]
    if metrics is None:
        rows += ["", "_no metrics file_"]
        return "\n".join(rows)
    rows += ["", "| metric | value |", "|---|---|"]
    for key, value in sorted(metrics.items()):
        text = json.dumps(value, default=str) if isinstance(value, dict | list) else str(value)
        rows.append(f"| {key} | {text.replace('|', '/')[:200]} |")
    return "\n".join(rows)


def publish_stage_artifact(
    root: str, stage: str, outcome: dict, restore: str | None, metrics_dir: str, link: str | None
) -> None:
    """A markdown artifact (key ``stage-<name>-<item>``) with the stage's metrics JSON and MLflow link."""
    path = metrics_path(root, metrics_dir, stage)
    try:
        metrics = json.loads(path.read_text())
        metrics = metrics if isinstance(metrics, dict) else {"value": metrics}
    except (OSError, ValueError):
        metrics = None
    create_markdown_artifact(
        stage_markdown(stage, outcome, restore, metrics, link),
        key=artifact_key("stage", stage), description=f"{stage}: {outcome['status']}",
    )


def publish_stage_table(target: str, rows: list[StageRow]) -> None:
    """The ``stages-<target>`` table artifact; its description counts the outcomes."""
    counts = ", ".join(f"{n} {outcome}" for outcome, n in Counter(r.outcome for r in rows).items())
    create_table_artifact(
        [asdict(r) for r in rows], key=artifact_key("stages", target), description=f"stages up to {target}: {counts}"
    )


def fenced(text: str) -> str:
    """``text`` as a fenced code block whose fence is longer than any run of backticks inside it."""
    fence = "`" * max(3, 1 + max((len(run) for run in re.findall(r"`+", text)), default=0))
    return f"{fence}\n{text}\n{fence}"


def failure_markdown(target: str, rows: list[StageRow], exc: BaseException, tail_lines: int = TAIL_LINES) -> str:
    """The failed stage (if the error came from one), the exception's type, the stages not run, and the last
    ``tail_lines`` lines of the exception's message."""
    failed = next((r for r in rows if r.outcome == "failed"), None)
    where = f"**{failed.stage}** failed after {failed.seconds:.1f} s" if failed else "The flow failed outside a stage"
    lines = str(exc).splitlines()[-tail_lines:] or ["(no message)"]
    text = [f"### stages up to {target}: failed", "", f"{where}: `{type(exc).__qualname__}`"]
    if not_run := [r.stage for r in rows if r.outcome == "not run"]:
        text += ["", "Not run: " + ", ".join(not_run)]
    return "\n".join([*text, "", f"Last {len(lines)} line(s) of the error:", "", fenced("\n".join(lines))])


def publish_failure(target: str, rows: list[StageRow], exc: BaseException) -> None:
    """The stage table and the ``failure-<target>`` artifact. An error here is logged, not raised: the
    flow must fail with the stage's own error."""
    try:
        publish_stage_table(target, rows)
        create_markdown_artifact(
            failure_markdown(target, rows, exc), key=artifact_key("failure", target),
            description=f"stages up to {target}: {type(exc).__qualname__}",
        )
    except Exception:  # noqa: BLE001 - see the docstring
        get_run_logger().exception("could not publish the failure artifacts of %s", target)
