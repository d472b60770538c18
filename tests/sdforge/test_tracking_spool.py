"""``tracking.spool``: a short stage's MLflow run, spooled and replayed, is the run a direct log makes; a direct
run replays the spool first; a failed stage stays FAILED; a bad entry is set aside, never lost."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sdforge.config import Tracking
from sdforge.tracking import NOTE_TAG, PARENT_TAG, STAGE_TAG, flush_spool, stage_run, summarise
from sdforge.tracking_spool import FAILED, pending, spool_dir

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the sqlite store's default artifact root is ./mlruns
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return tmp_path


def _cfg(store: Path, experiment: str, spool: bool = True) -> Tracking:
    return Tracking(mlflow_uri=f"sqlite:///{store / 'mlflow.db'}", experiment=experiment, spool=spool)


def _log_a_stage(cfg: Tracking, figure_file: Path, fail: bool = False) -> None:
    """What the short stages log: params, metrics (with a step), a dict, a figure, a file, a tag, a summary."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(2, 2))
    ax.plot([0, 1], [1, 0])
    figure_file.write_text("sixteen bytes...")
    with stage_run(cfg, "phase3", "mix_phase", {"mix": {"laion": 0.5}}, {"phase": {"lr": 1e-4}}, deferrable=True) as m:
        m.log_metrics({"samples": 192, "bucket.32x32": 64})
        m.log_metrics({"progress.done": 5.0}, step=5)
        m.log_dict({"a": 1}, "mix/one.json")
        m.log_figure(fig, "mix_composition.png")
        m.log_artifact(str(figure_file), "files")
        m.set_tag("grid", "none")
        summarise(m, metrics={"samples": 192}, note="- phase3 mix: 192 samples", artifacts=[(figure_file, "summary")])
        if fail:
            raise RuntimeError("the stage failed")


def _runs(cfg: Tracking) -> tuple[object, object, list[str], list[str]]:
    """The child run, its parent, the child's and the parent's artifact paths."""
    import mlflow

    client = mlflow.MlflowClient(cfg.mlflow_uri)
    exp = client.get_experiment_by_name(cfg.experiment)
    (child,) = client.search_runs([exp.experiment_id], f"tags.`{STAGE_TAG}` = 'mix_phase'")
    (parent,) = client.search_runs([exp.experiment_id], f"tags.`{PARENT_TAG}` = 'phase3'")

    def paths(run_id: str, under: str = "") -> list[str]:
        out = []
        for info in client.list_artifacts(run_id, under or None):
            out += paths(run_id, info.path) if info.is_dir else [info.path]
        return sorted(out)

    return child, parent, paths(child.info.run_id), paths(parent.info.run_id)


def test_a_spooled_run_replays_into_what_a_direct_run_logs(store):
    spooled, direct = _cfg(store, "spooled"), _cfg(store, "direct", spool=False)
    _log_a_stage(spooled, store / "f.txt")
    assert len(pending(spool_dir(spooled.mlflow_uri))) == 1
    import mlflow

    assert mlflow.MlflowClient(spooled.mlflow_uri).get_experiment_by_name("spooled") is None  # nothing logged yet
    assert flush_spool(spooled) == 1 and pending(spool_dir(spooled.mlflow_uri)) == []
    _log_a_stage(direct, store / "f.txt")

    (a_child, a_parent, a_files, a_parent_files), (b_child, b_parent, b_files, b_parent_files) = (
        _runs(spooled), _runs(direct)
    )  # fmt: skip
    assert a_child.data.params == b_child.data.params == {"mix.laion": "0.5"}
    assert a_child.data.metrics == b_child.data.metrics == {"samples": 192, "bucket.32x32": 64, "progress.done": 5}
    assert a_files == b_files == ["files/f.txt", "mix/one.json", "mix_composition.png"]
    assert a_parent_files == b_parent_files == ["summary/f.txt"]
    assert a_parent.data.metrics == b_parent.data.metrics == {"mix_phase.samples": 192}
    assert a_parent.data.params == b_parent.data.params == {"phase.lr": "0.0001"}
    assert a_parent.data.tags[NOTE_TAG] == b_parent.data.tags[NOTE_TAG]
    assert a_child.data.tags["grid"] == "none" and "sdforge.spooled_ms" in a_child.data.tags
    assert a_child.data.tags["mlflow.source.name"] == b_child.data.tags["mlflow.source.name"]  # the stage's own
    assert a_child.info.status == b_child.info.status == "FINISHED"


def test_a_direct_run_replays_the_spool_first_and_a_failed_stage_stays_failed(store):
    cfg = _cfg(store, "order")
    with pytest.raises(RuntimeError, match="the stage failed"):
        _log_a_stage(cfg, store / "f.txt", fail=True)
    with stage_run(cfg, "phase3", "train", {"lr": 1}) as mlflow:
        mlflow.log_metrics({"loss": 0.5})
    assert pending(spool_dir(cfg.mlflow_uri)) == []
    client = mlflow.MlflowClient(cfg.mlflow_uri)
    exp = client.get_experiment_by_name("order")
    runs = client.search_runs([exp.experiment_id], f"tags.`{STAGE_TAG}` != ''", order_by=["attributes.start_time"])
    assert [r.data.tags[STAGE_TAG] for r in runs] == ["mix_phase", "train"]
    assert [r.info.status for r in runs] == ["FAILED", "FINISHED"]
    parents = {r.data.tags["mlflow.parentRunId"] for r in runs}
    assert len(parents) == 1  # both under the one phase3 parent run


def test_a_bad_entry_is_set_aside_with_a_warning_and_the_others_are_replayed(store, caplog):
    cfg = _cfg(store, "bad")
    _log_a_stage(cfg, store / "f.txt")
    _log_a_stage(cfg, store / "f.txt")
    first, _ = pending(spool_dir(cfg.mlflow_uri))
    spec = json.loads((first / "entry.json").read_text())
    spec["calls"].append({"call": "no_such_call"})
    (first / "entry.json").write_text(json.dumps(spec))
    assert flush_spool(cfg) == 1
    assert (spool_dir(cfg.mlflow_uri) / FAILED / first.name / "entry.json").is_file()  # kept for a look
    assert "could not replay the spooled MLflow run" in caplog.text and "no_such_call" in caplog.text


def test_only_a_local_sqlite_store_is_spooled_and_a_spooling_stage_never_imports_mlflow(store):
    assert spool_dir("http://127.0.0.1:5000") is None and spool_dir("sqlite:///:memory:") is None
    assert spool_dir("sqlite:////abs/m.db") == Path("/abs/m.db.spool")
    code = (
        "import sys\n"
        "from sdforge.config import Tracking\n"
        "from sdforge.tracking import log_stage\n"
        f"cfg = Tracking(mlflow_uri='sqlite:///{store}/mlflow.db')\n"
        "log_stage(cfg, 'data', 'download_metadata@x', {'files': 2})\n"
        "print('mlflow' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=store,
                         env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})  # fmt: skip
    assert out.stdout.strip() == "False"
    assert len(pending(store / "mlflow.db.spool")) == 1 and not (store / "mlflow.db").exists()
