"""Open the MLflow pages a user opens after ``make demo`` in headless Chromium and check what they show.

    python -m tools.browser_check --out screenshots/      # in a finished workspace (after make demo)

Starts ``mlflow server`` over the workspace's tracking store on a free loopback port, then loads, in Debian's
Chromium driven by Playwright: the experiment (it must open on the runs table, listing the phase runs), the
last phase's parent run (its params, headline metrics with the values of ``metrics/train/<phase>.json``, and
its description), that run's ``grid.png`` artifact (the image must load: non-zero natural size), and the
``report`` run's ``report.html`` artifact (its table must list every phase). With ``--prefect-ui`` (after
``make stack-up`` and a deployment run), also the newest flow run's stage table artifact: every stage with
its outcome, the MLflow cells as links, and the last one followed to its MLflow run. Saves a screenshot of
each page to ``--out`` and prints one line per check; exits 1 when a check fails. Needs ``/usr/bin/chromium``
(``apt-get install chromium``; ``.ci/run`` installs it) and the ``playwright`` package (no browser download).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from sdforge.config import Params, load_params
from sdforge.tracking import PARENT_TAG, flush_spool, newest_parent, tracking_uri, ui_route
from tools.tiny_demo import free_port

log = logging.getLogger("sdforge.browser_check")

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync",
]
"""Without the background-networking switches Chromium keeps dialling Google on a closed network."""
PAGE_TIMEOUT_MS = 60_000


@dataclass
class Checks:
    """The outcome of each check, in order."""

    results: list[tuple[str, bool, str]] = field(default_factory=list)

    def add(self, name: str, ok: bool, detail: str = "") -> None:
        """Record (and print) one check."""
        self.results.append((name, ok, detail))
        print(f"{'PASS' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}", flush=True)

    @property
    def ok(self) -> bool:
        """True when every check passed (and there was at least one)."""
        return bool(self.results) and all(ok for _, ok, _ in self.results)


@contextlib.contextmanager
def mlflow_server(uri: str, cwd: Path, port: int, timeout_s: float = 90) -> Iterator[str]:
    """``mlflow server`` over ``uri`` on ``127.0.0.1:port`` (from ``cwd``, where the store's ``./mlruns`` is);
    yields its base URL once it answers, stops it afterwards."""
    cmd = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", uri, "--host", "127.0.0.1",
           "--port", str(port), "--workers", "1"]
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    err = proc.stderr.read()[-2000:] if proc.poll() is not None else "no answer"
                    raise RuntimeError(f"mlflow server on port {port} did not start: {err}") from None
                time.sleep(0.5)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()


def _text(page, url: str, wait_for: list[str]) -> str:
    """Load ``url`` and return the page's text once it holds every string of ``wait_for`` (or, when they never
    all show, after :data:`PAGE_TIMEOUT_MS`: the checks then fail on what is missing)."""
    # lazy: playwright is only needed when checking
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    page.goto(url)
    try:
        page.wait_for_function(
            "(words) => words.every(w => document.body.innerText.includes(w))", arg=wait_for, timeout=PAGE_TIMEOUT_MS
        )
    except PlaywrightTimeout:
        log.warning("%s: still missing some of %s after %d ms", url, wait_for, PAGE_TIMEOUT_MS)
    return page.inner_text("body")


def check_experiment(page, base: str, experiment_id: str, parents: list[str], out: Path, checks: Checks) -> None:
    """The experiment opens on the runs table, listing every parent run."""
    text = _text(page, base + ui_route(experiment_id), ["Run Name", *parents])
    page.screenshot(path=str(out / "1-experiment.png"))
    missing = [name for name in parents if name not in text.split()]
    checks.add("experiment opens on the runs table with every parent run", not missing,
               f"missing: {missing}" if missing else ", ".join(parents))


def check_phase_run(page, base: str, run, train: dict, out: Path, checks: Checks) -> None:
    """The phase's parent run shows its params, the train stage's figures and its description."""
    name = run.data.tags[PARENT_TAG]
    text = _text(page, base + ui_route(run.info.experiment_id, run.info.run_id), ["train.final_loss", "Weights"])
    page.screenshot(path=str(out / "2-phase-run.png"), full_page=True)
    counts = {k: int(n) for k, n in re.findall(r"(Metrics|Parameters) \((\d+)\)", text)}
    checks.add(f"{name} run lists metrics and params", counts.get("Metrics", 0) > 0 < counts.get("Parameters", 0),
               f"{counts}")
    shown = {k: str(train[k]) in text for k in ("final_loss", "steps", "samples_per_s")}
    checks.add(f"{name} run shows train's final_loss, steps, samples/s", all(shown.values()),
               ", ".join(f"{k}={train[k]}" for k in shown))
    checks.add(f"{name} run shows its description", all(w in text for w in ("Training", "Weights", "Eval")))


def check_grid(page, base: str, run, grid: Path, out: Path, checks: Checks) -> None:
    """The phase's ``grid.png`` artifact is shown and the image loads at the size of ``grid`` on disk."""
    # lazy: PIL only to read the grid's size
    from PIL import Image

    want = Image.open(grid).size
    page.goto(base + ui_route(run.info.experiment_id, run.info.run_id, "grid.png"))
    js = "([w, h]) => [...document.images].some(i => i.complete && i.naturalWidth === w && i.naturalHeight === h)"
    try:
        page.wait_for_function(js, arg=list(want), timeout=PAGE_TIMEOUT_MS)
        loaded = True
    except Exception:  # noqa: BLE001 - playwright's TimeoutError: recorded as a failed check
        loaded = False
    page.screenshot(path=str(out / "3-grid-artifact.png"))
    checks.add("grid.png artifact loads", loaded, f"{want[0]}×{want[1]} px like {grid}")


def check_report(page, base: str, run, phases: list[str], out: Path, checks: Checks) -> None:
    """The ``report`` run's ``report.html`` renders, with every phase in its table and its images loaded."""
    page.goto(base + ui_route(run.info.experiment_id, run.info.run_id, "report.html"))
    frame = page.frame_locator("iframe").first
    frame.locator("#phases").wait_for(timeout=PAGE_TIMEOUT_MS)
    table = frame.locator("#phases").inner_text()
    loaded = frame.locator("img").evaluate_all("(imgs) => imgs.filter(i => i.naturalWidth > 0).length")
    page.screenshot(path=str(out / "4-report.png"))
    missing = [p for p in phases if p not in table]
    checks.add("report.html artifact lists every phase", not missing, f"missing: {missing}" if missing else "")
    checks.add("report.html images load", loaded >= 2, f"{loaded} images")


def check_pages(params: Params, base: str, out: Path, checks: Checks, prefect_ui: str | None = None) -> None:
    """Open the experiment, the last phase's parent run, its grid and the report (and with ``prefect_ui``
    the newest flow run's stage table); record the checks."""
    # lazy: playwright and mlflow are only needed when checking
    import mlflow
    from playwright.sync_api import sync_playwright

    phases = params.phase_names()
    client = mlflow.MlflowClient(tracking_uri(params.tracking))
    experiment = client.get_experiment_by_name(params.tracking.experiment)
    run, report = (newest_parent(client, experiment.experiment_id, n) for n in (phases[-1], "report"))
    train = json.loads((Path(params.paths.metrics) / "train" / f"{phases[-1]}.json").read_text())
    out.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1600, "height": 1000})
        check_experiment(page, base, experiment.experiment_id, phases + ["data", "models", "report"], out, checks)
        if run is None:
            checks.add(f"a {phases[-1]} parent run exists", False)
        else:
            check_phase_run(page, base, run, train, out, checks)
            check_grid(page, base, run, Path(params.paths.eval) / phases[-1] / "grid.png", out, checks)
        if report is None:
            checks.add("a report parent run exists", False)
        else:
            check_report(page, base, report, phases, out, checks)
        if prefect_ui:
            check_prefect(page, prefect_ui, out, checks)
        browser.close()


def newest_stage_table() -> tuple[str, list[dict]]:
    """The newest ``stages-<target>`` table artifact on the Prefect server of ``PREFECT_API_URL``: its id and
    rows (flows/run_artifacts.py)."""
    # lazy: the Prefect client only for the Prefect check
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterType
    from prefect.client.schemas.sorting import ArtifactSort

    tables = ArtifactFilter(type=ArtifactFilterType(any_=["table"]))
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=tables, sort=ArtifactSort.CREATED_DESC, limit=50)
    artifact = next(a for a in found if (a.key or "").startswith("stages-"))
    rows = json.loads(artifact.data) if isinstance(artifact.data, str) else artifact.data
    return str(artifact.id), rows


def check_prefect(page, prefect_ui: str, out: Path, checks: Checks) -> None:
    """The newest flow run's stage table shows every stage with its outcome, its MLflow cells are links,
    and following the last stage's link opens that stage's MLflow run."""
    artifact_id, rows = newest_stage_table()
    text = _text(page, f"{prefect_ui.rstrip('/')}/artifacts/artifact/{artifact_id}", [r["stage"] for r in rows])
    page.screenshot(path=str(out / "5-prefect-stage-table.png"), full_page=True)
    shown = [r["stage"] for r in rows if r["stage"] in text and r["outcome"] in text]
    outcomes = sorted({r["outcome"] for r in rows})
    checks.add("Prefect stage table lists every stage with its outcome", len(shown) == len(rows),
               f"{len(shown)}/{len(rows)} stages; outcomes {outcomes}")
    links = page.eval_on_selector_all("a[href*='#/experiments/']", "els => els.map(e => e.href)")
    wanted = [r["mlflow"] for r in rows if r["mlflow"]]
    checks.add("its MLflow cells are links", links == wanted, f"{len(links)} links for {len(wanted)} runs")
    if not wanted:
        return
    stage = next(r["stage"] for r in reversed(rows) if r["mlflow"])
    page.locator(f"a[href='{wanted[-1]}']").first.click()
    name = stage.split("@")[0]
    text = _text(page, wanted[-1], ["Overview", name])
    page.screenshot(path=str(out / "6-prefect-link-to-mlflow.png"))
    checks.add(f"following {stage}'s link opens its MLflow run", "Metrics" in text and name in text, wanted[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--out", default="screenshots", help="folder for the page screenshots")
    ap.add_argument("--port", type=int, default=0, help="port of the MLflow server it starts (default: a free one)")
    ap.add_argument("--prefect-ui", default=None, metavar="URL",
                    help="also check the newest flow run's stage table there (PREFECT_API_URL set); MLflow is then "
                         "served at tracking.ui_url, where the table's links point")
    args = ap.parse_args(argv)
    params = load_params(args.params)
    if not os.path.exists(CHROMIUM):
        print(f"{CHROMIUM} not found: apt-get install chromium", file=sys.stderr)
        return 2
    port = args.port or (urlsplit(params.tracking.ui_url).port if args.prefect_ui else None) or free_port()
    checks = Checks()
    flush_spool(params.tracking)  # short stages' spooled runs, before the server reads the store
    with mlflow_server(tracking_uri(params.tracking), Path.cwd(), port) as base:
        check_pages(params, base, Path(args.out), checks, args.prefect_ui)
    return 0 if checks.ok else 1


if __name__ == "__main__":
    sys.exit(main())
