"""Open the MLflow pages a user opens after ``make demo`` in headless Chromium and check what they show.

    python -m tools.browser_check --out screenshots/      # in a finished workspace (after make demo)

Starts ``mlflow server`` over the workspace's tracking store on a free loopback port, then loads, in Debian's
Chromium driven by Playwright: the experiment (it must open on the runs table, listing the phase runs), the
last phase's parent run (its params, headline metrics with the values of ``metrics/train/<phase>.json``, and
its description), that run's ``grid.png`` artifact (the image must load: non-zero natural size), and the
``report`` run's ``report.html`` artifact (its table must list every phase). Saves a screenshot of each page
to ``--out`` and prints one line per check; exits 1 when a check fails. Needs ``/usr/bin/chromium``
(``apt-get install chromium``; ``.ci/run`` installs it) and the ``playwright`` package (no browser download).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from sdforge.config import Params, load_params
from sdforge.tracking import PARENT_TAG, tracking_uri
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


def newest_parent(client, experiment_id: str, name: str):
    """The newest parent run ``name`` (phase, ``report``) of the experiment, or None."""
    runs = client.search_runs(
        [experiment_id], f"tags.`{PARENT_TAG}` = '{name}'", order_by=["attributes.start_time DESC"], max_results=1
    )
    return runs[0] if runs else None


def _text(page, url: str, wait_for: str) -> str:
    """Load ``url`` and return the page's text once ``wait_for`` shows."""
    page.goto(url)
    page.get_by_text(wait_for, exact=False).first.wait_for(timeout=PAGE_TIMEOUT_MS)
    page.wait_for_load_state("networkidle")
    return page.inner_text("body")


def check_pages(params: Params, base: str, out: Path, checks: Checks) -> None:
    """Open the experiment, the last phase's parent run, its grid and the report; record the checks."""
    # lazy: playwright and mlflow are only needed when checking
    import mlflow
    from playwright.sync_api import sync_playwright

    phase = params.phase_names()[-1]
    client = mlflow.MlflowClient(tracking_uri(params.tracking))
    experiment = client.get_experiment_by_name(params.tracking.experiment)
    run, report = (newest_parent(client, experiment.experiment_id, n) for n in (phase, "report"))
    train = json.loads((Path(params.paths.metrics) / "train" / f"{phase}.json").read_text())
    out.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1600, "height": 1000})
        exp_url = f"{base}/#/experiments/{experiment.experiment_id}"
        text = _text(page, exp_url, phase)
        page.screenshot(path=str(out / "1-experiment.png"))
        names = [n for n in params.phase_names() + ["data", "models", "report"] if n in text]
        checks.add("experiment opens on the runs table", "Traces" not in text[:400] and phase in text,
                   f"{len(names)} parent runs listed: {', '.join(names)}")
        run_url = f"{exp_url}/runs/{run.info.run_id}"
        text = _text(page, run_url, "train.final_loss")
        page.screenshot(path=str(out / "2-phase-run.png"), full_page=True)
        final = f"{train['final_loss']:.4g}"[:5]
        checks.add(f"{phase} run shows train.final_loss {train['final_loss']}", final in text)
        checks.add(f"{phase} run shows its params", "phase.lr" in text and "Parameters (0)" not in text)
        checks.add(f"{phase} run shows its description", "Training" in text and "Weights" in text)
        page.goto(f"{run_url}/artifacts/grid.png")
        img = page.locator("img[src*='grid.png']").first
        img.wait_for(timeout=PAGE_TIMEOUT_MS)
        page.wait_for_function("(el) => el.complete && el.naturalWidth > 0", arg=img.element_handle(),
                               timeout=PAGE_TIMEOUT_MS)
        width = img.evaluate("(el) => el.naturalWidth")
        page.screenshot(path=str(out / "3-grid-artifact.png"))
        checks.add(f"{phase} grid.png artifact loads", width > 0, f"{width} px wide")
        page.goto(f"{exp_url}/runs/{report.info.run_id}/artifacts/report.html")
        frame = page.frame_locator("iframe").first
        frame.locator("#phases").wait_for(timeout=PAGE_TIMEOUT_MS)
        table = frame.locator("#phases").inner_text()
        page.screenshot(path=str(out / "4-report.png"))
        missing = [n for n in params.phase_names() if n not in table]
        checks.add("report.html artifact lists every phase", not missing, f"missing: {missing}" if missing else "")
        browser.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--out", default="screenshots", help="folder for the page screenshots")
    ap.add_argument("--port", type=int, default=0, help="port of the MLflow server it starts (default: a free one)")
    args = ap.parse_args(argv)
    params = load_params(args.params)
    if not os.path.exists(CHROMIUM):
        print(f"{CHROMIUM} not found: apt-get install chromium", file=sys.stderr)
        return 2
    checks = Checks()
    with mlflow_server(tracking_uri(params.tracking), Path.cwd(), args.port or free_port()) as base:
        check_pages(params, base, Path(args.out), checks)
    return 0 if checks.ok else 1


if __name__ == "__main__":
    sys.exit(main())
