"""``sdforge preflight``: the full configuration's whole DAG, on the real architectures, on a small sample.

Steps (docs/PREFLIGHT.md is the manual):

1. a scratch workspace (``--out``) gets a copy of the project's DAG (``dvc.yaml``, ``stages/``, ``sdforge/``,
   ``model/``, ``tools/``), a params file derived from ``--params`` by :func:`sdforge.preflight.derive.derive_params`
   and each source's sample in its kind's real on-disk format (:mod:`sdforge.preflight.samples`); URL sources
   are served on loopback for the whole run;
2. ``dvc repro -s --no-commit <stage>`` runs each stage the last phase's eval needs, ``prepare_models`` first
   (it checks the architectures against each other: the cheapest mistake to catch), each with its own log in
   ``logs/``, its wall time and its peak RSS (``wait4``: the stage process and everything it started);
   ``--no-commit`` keeps the DVC cache from doubling the ~7 GB per phase checkpoint;
3. after each ``train@<phase>``: its UNet loads with ``from_pretrained`` and has the configured parameter
   count; its resumable run dir (~14 GB at full size) and the checkpoints no later stage reads are deleted
   (``--keep`` keeps them), so the disk holds at most two phases;
4. ``sdforge export`` and ``sdforge generate`` on the last phase (the user's own commands);
5. the forecast (:mod:`sdforge.preflight.forecast`) printed, written to ``forecast.md`` / ``forecast.json`` and
   logged to the workspace's MLflow; last line ``RESULT name=preflight ok=<true|false> ...``.

The first failing step stops the preflight with the stage's name, its error line and its log's path.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

from flows.dvc_ops.dag import upstream_stages
from sdforge.config import ConfigError, load_params, parse_params
from sdforge.demo.http_server import serve_directory
from sdforge.eval.sampling import saved_family
from sdforge.io import InputError
from sdforge.output_dirs import check_scratch_dir, mark_scratch_dir
from sdforge.preflight.derive import COCO_DIR, HTTP_DIR, Shrink, derive_params, samples_needed
from sdforge.preflight.forecast import GIB, Pod, StageRun, forecast, table
from sdforge.preflight.phase_memory import (
    forecast_phases,
    frozen_base_phases,
    measure_setup,
    memory_rows,
    memory_table,
    unmodelled,
)
from sdforge.preflight.samples import COCO_SIDE, write_coco_val, write_control_image, write_sample_source
from sdforge.training.reporting import read_steps
from tools.tiny_demo import merged

log = logging.getLogger("sdforge.preflight")

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OVERLAY = "configs/full/distill.yaml"
"""The full run's optional phases (LCM-LoRA): rehearsed by default so the forecast has their rows."""
COPIED = ("dvc.yaml", ".dvcignore", "stages", "sdforge", "model", "tools", "flows")
WORKSPACE_MARKER = ".sdforge-preflight"
"""Written first into ``--out``: only a folder holding it is replaced by the next preflight."""
GENERATE_PROMPT = "a photo of a red fox in the snow"
CONTROL_SIDE = 512
"""The generate step's image side on a ControlNet phase (SD 1.5's native size), its condition's too."""
CANNY_DEFAULT = {"low_threshold": 100, "high_threshold": 200}
"""Canny thresholds when the params name none (ControlNet 1.1's annotator, as ``conditions.canny``'s defaults)."""


class PreflightFailed(RuntimeError):
    """A step failed: ``str()`` names the step, its error line and its log."""


@dataclass
class Workspace:
    """The scratch project the preflight runs in."""

    root: Path
    params: dict[str, Any]
    full: dict[str, Any]

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    def path(self, key: str) -> Path:
        return self.root / self.params["paths"][key]


# ------------------------------------------------------------------------------------------ workspace


def make_workspace(out: Path, full: dict[str, Any], shrink: Shrink) -> Workspace:
    """A fresh ``out`` holding the DAG's code, the derived params and a DVC repo without git. ``out`` must be
    new, empty or a previous preflight's workspace (its :data:`WORKSPACE_MARKER`), which is replaced; never the
    project or a folder around it (:func:`sdforge.output_dirs.check_scratch_dir`)."""
    try:
        previous = check_scratch_dir(out, WORKSPACE_MARKER, "preflight workspace", REPO, COPIED)
    except InputError as err:
        raise PreflightFailed(str(err)) from None
    if previous:
        shutil.rmtree(out)  # a previous preflight's scratch workspace (its marker says so), replaced as --out says
    mark_scratch_dir(out, WORKSPACE_MARKER, "preflight workspace")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in COPIED:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, out / name, ignore=ignore)
        elif src.is_file():
            shutil.copy2(src, out / name)
    params = derive_params(full, shrink, REPO)
    (out / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    subprocess.run([sys.executable, "-m", "dvc", "init", "--no-scm", "-q"], cwd=out, check=True, env=stage_env())
    ws = Workspace(out, params, full)
    ws.logs.mkdir()
    return ws


def write_samples(ws: Workspace, n: int, url_base: str, seed: int) -> dict[str, dict]:
    """Each source's sample: ``n`` items, or more where a phase draws more from it."""
    need = samples_needed(ws.params)
    written = {}
    for name, source in ws.params["sources"].items():
        count = max(n, need.get(name, 0))
        try:
            written[name] = write_sample_source(
                name, source, ws.root / source["repo"], ws.root / HTTP_DIR, url_base, count, seed
            )
        except ValueError as err:
            raise PreflightFailed(f"samples of sources.{name}: {err}") from None
    coco = ws.params.get("eval", {}).get("coco") or {}
    if coco.get("phase_end_samples"):  # the COCO protocol's captions and reference images
        write_coco_val(ws.root / COCO_DIR, max(n, int(coco["phase_end_samples"])), COCO_SIDE, seed)
    return written


MALLOC_MMAP_THRESHOLD = str(1 << 20)
"""glibc: allocations ≥ 1 MiB get their own mapping, returned to the system when freed. With glibc's default
(a threshold that grows to 32 MiB) freed per-step gradients stayed in the heap: the full-size train stage
peaked at 20.0–20.3 GiB; with 1 MiB at 19.5–19.6 GiB, each phase ~15 s slower (page faults; docs/HISTORY.md,
issue 15). A CPU run of the full UNet should set ``MALLOC_MMAP_THRESHOLD_`` too."""


def stage_env() -> dict[str, str]:
    """The stages' environment: this interpreter first on PATH, offline hubs, the workspace's MLflow, and
    :data:`MALLOC_MMAP_THRESHOLD` unless the caller set one."""
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", DVC_NO_ANALYTICS="1", PYTHONUNBUFFERED="1")
    env.setdefault("MALLOC_MMAP_THRESHOLD_", MALLOC_MMAP_THRESHOLD)
    return env


# ------------------------------------------------------------------------------------------ running


def run_measured(cmd: list[str], cwd: Path, log_path: Path) -> tuple[int, float, int]:
    """Run ``cmd`` with its output in ``log_path``; (exit status, wall seconds, peak RSS bytes of its tree)."""
    t0 = time.perf_counter()
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, env=stage_env())
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, time.perf_counter() - t0, usage.ru_maxrss * 1024


def error_line(log_path: Path) -> str:
    """The first error a stage logged (the stage's own message before DVC's summary), else the log's tail."""
    lines = log_path.read_text(errors="replace").splitlines()
    for marker in (" ERROR ", "Error: ", "ERROR:"):
        hits = [line.strip() for line in lines if marker in line]
        if hits:
            return hits[0][:600]
    return " | ".join(line.strip() for line in lines[-5:])[:600]


def run_step(ws: Workspace, name: str, cmd: list[str]) -> StageRun:
    """One measured step; :class:`PreflightFailed` naming it, its error and its log when it fails."""
    log_path = ws.logs / f"{name.replace('@', '-')}.log"
    log.info("preflight: %s ...", name)
    rc, wall, rss = run_measured(cmd, ws.root, log_path)
    if rc != 0:
        raise PreflightFailed(f"{name} failed (exit {rc}): {error_line(log_path)} — log: {log_path}")
    log.info("preflight: %s done in %.1f s, peak RSS %.2f GiB", name, wall, rss / GIB)
    return StageRun(name=name, wall_s=round(wall, 2), peak_rss_bytes=rss, metrics=stage_metrics(ws, name))


def stage_metrics(ws: Workspace, name: str) -> dict[str, Any]:
    """The stage's metrics JSON (``metrics/<stage>[/<item>].json``), or {}."""
    stage, _, item = name.partition("@")
    path = ws.path("metrics") / (f"{stage}/{item}.json" if item else f"{stage}.json")
    return json.loads(path.read_text()) if path.is_file() else {}


def stage_order(ws: Workspace, eval_all: bool) -> list[str]:
    """The stages the last phase's eval (every phase's with ``eval_all``) needs, ``prepare_models`` first."""
    phases = list(ws.params["phases"])
    targets = [f"eval_grid@{p}" for p in (phases if eval_all else phases[-1:])]
    order = upstream_stages(ws.root, targets)
    return sorted(order, key=lambda s: s != "prepare_models")  # stable: the rest keep DVC's order


# ------------------------------------------------------------------------------------------ checkpoints


def check_phase(ws: Workspace, phase: str, run: StageRun) -> None:
    """Record the phase's steps and checkpoint facts in ``run``; the EMA UNet must load with its full size."""
    run_dir = ws.path("runs") / phase
    world = int(run.metrics.get("world_size", 1))
    run.steps = [(float(s["step_time_s"]), int(s["samples"]) * world) for s in read_steps(run_dir).values()]
    run.metrics["resumable_checkpoint_gib"] = round(_size(run_dir) / GIB, 2)
    run.metrics["phase_checkpoint_gib"] = round(_size(ws.path("checkpoints") / phase) / GIB, 2)
    folder = ws.path("checkpoints") / phase / "unet_ema"
    unet = saved_family(folder).model_class().from_pretrained(folder, use_safetensors=True)
    run.metrics["unet_params"] = sum(p.numel() for p in unet.parameters())
    del unet


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


def prune(ws: Workspace, done: set[str], order: list[str]) -> list[str]:
    """Delete run dirs of trained phases and checkpoints no remaining stage (or the export) reads."""
    phases = ws.params["phases"]
    remaining = [s for s in order if s not in done]
    readers = {name: {f"eval_grid@{name}"} for name in ["scratch", *phases]}
    for name, phase in phases.items():
        readers.setdefault(phase["init_from"], set()).add(f"train@{name}")
    removed = []
    for name in phases:
        if f"train@{name}" in done and (ws.path("runs") / name).exists():
            shutil.rmtree(ws.path("runs") / name)
            removed.append(str(ws.path("runs") / name))
    keep = list(phases)[-1]
    for name, users in readers.items():
        ckpt = ws.path("checkpoints") / name
        if name != keep and ckpt.exists() and not (users & set(remaining)) and (users & done):
            shutil.rmtree(ckpt)
            removed.append(str(ckpt))
    return removed


# ------------------------------------------------------------------------------------------ the run


def run_dag(ws: Workspace, order: list[str], keep: bool) -> list[StageRun]:
    """Every stage of ``order`` through ``dvc repro -s --no-commit``, measured, checked and pruned as it goes."""
    runs, done = [], set()
    for stage in order:
        run = run_step(ws, stage, [sys.executable, "-m", "dvc", "repro", "-s", "--no-commit", stage])
        if stage.startswith("train@"):
            check_phase(ws, stage.split("@", 1)[1], run)
        runs.append(run)
        done.add(stage)
        if not keep:
            for path in prune(ws, done, order):
                log.info("preflight: removed %s (no later stage reads it)", path)
    return runs


def run_user_commands(ws: Workspace) -> list[StageRun]:
    """``sdforge export`` and ``sdforge generate`` (2 steps, one image) on the last phase, measured; a ControlNet
    phase's under a Canny map of a drawn sample (:data:`CONTROL_SIDE` px square)."""
    cli = [sys.executable, "-m", "tools.cli"]
    export = run_step(ws, "export", [*cli, "export", "--out", "export", "--params", "params.yaml"])
    gen_cmd = [*cli, "generate", "--prompt", GENERATE_PROMPT, "--steps", "2", "--out", "generated"]
    if list(ws.params["phases"].values())[-1].get("controlnet"):
        thresholds = ws.params.get("conditions", {}).get("canny") or CANNY_DEFAULT
        control = write_control_image(ws.root / "control.png", CONTROL_SIDE, thresholds)
        side = str(CONTROL_SIDE)
        gen_cmd += ["--control-image", str(control), "--width", side, "--height", side]
    generate = run_step(ws, "generate", [*gen_cmd, "--params", "params.yaml"])
    export.metrics = json.loads((ws.root / "export" / "sdforge_export.json").read_text())
    generate.metrics = {"images": len(list((ws.root / "generated").glob("*.png")))}
    return [export, generate]


def log_to_mlflow(ws: Workspace, runs: list[StageRun], totals: dict, text: str) -> str:
    """A ``preflight`` run in the workspace's MLflow: per-stage wall time and peak RSS, the forecast; its id."""
    import mlflow  # lazy: ~3 s of imports, needed once at the end

    mlflow.set_tracking_uri(f"sqlite:///{ws.root / 'mlflow.db'}")
    mlflow.set_experiment(ws.params.get("tracking", {}).get("experiment", "sdforge"))
    with mlflow.start_run(run_name="preflight") as active:
        for run in runs:
            key = run.name.replace("@", ".")
            mlflow.log_metrics({f"wall_s.{key}": run.wall_s, f"peak_rss_gib.{key}": run.peak_rss_bytes / GIB})
        mlflow.log_metrics({k: float(v) for k, v in totals.items() if isinstance(v, int | float)})
        mlflow.log_text(text, "forecast.md")
        mlflow.log_dict({"totals": totals, "stages": [asdict(r) for r in runs]}, "preflight.json")
        return active.info.run_id


def measured_table(runs: list[StageRun]) -> str:
    """One Markdown row per step: wall time and peak RSS."""
    lines = ["| step | wall s | peak RSS GiB |", "|---|---|---|"]
    lines += [f"| {r.name} | {r.wall_s:g} | {r.peak_rss_bytes / GIB:.2f} |" for r in runs]
    return "\n".join(lines)


def report(ws: Workspace, runs: list[StageRun], pod: Pod, device: str) -> tuple[str, dict]:
    """Write ``forecast.md`` / ``forecast.json``, log them to MLflow; return (the text, the totals)."""
    rows, totals = forecast(runs, ws.full, ws.params, pod, os.cpu_count() or 1)
    text = f"{measured_table(runs)}\n\n{table(rows, totals, device)}\n"
    (ws.root / "forecast.md").write_text(text)
    payload = {"rows": [asdict(r) for r in rows], "totals": totals, "stages": [asdict(r) for r in runs]}
    (ws.root / "forecast.json").write_text(json.dumps(payload, indent=1) + "\n")
    totals["mlflow_run_id"] = log_to_mlflow(ws, runs, totals, text)
    return text, totals


def pick_device(flag: str) -> str:
    """``--device``: ``cpu`` hides the GPUs from every stage (``CUDA_VISIBLE_DEVICES=""``); ``auto`` takes CUDA
    when there is one; ``cuda`` without a GPU is an error."""
    if flag == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        return "cpu"
    import torch  # lazy: the rest of the tool needs no torch

    if torch.cuda.is_available():
        return "cuda"
    if flag == "cuda":
        raise SystemExit("sdforge preflight --device cuda: no CUDA device is visible")
    return "cpu"


def result_line(ok: bool, wall: float, runs: list[StageRun], totals: dict, device: str) -> str:
    peak = max((r.peak_rss_bytes for r in runs), default=0) / GIB
    line = f"RESULT name=preflight ok={str(ok).lower()} device={device} stages={len(runs)} wall_s={wall:.0f}"
    line += f" peak_rss_gib={peak:.2f}"
    if totals:
        line += f" device_days={totals['device_days']} pod_hours={totals['pod_hours']}"
        line += f" pod_cost_usd={totals['pod_cost']:.0f}"
    return line


def preflight(args: argparse.Namespace) -> int:
    """Run the preflight described by ``args``; print the tables and the RESULT line; 0 when every step passed."""
    t0, device = time.perf_counter(), pick_device(args.device)
    runs: list[StageRun] = []
    ws, totals = None, {}
    try:
        full = read_params(Path(args.params), overlays(args.overlay))
        ws = make_workspace(Path(args.out).resolve(), full, _shrink(args, device))
        (ws.root / HTTP_DIR).mkdir(parents=True)
        with serve_directory(ws.root / HTTP_DIR, port=0) as url_base:
            write_samples(ws, args.samples, url_base, args.seed)
            runs = run_dag(ws, stage_order(ws, args.eval_all), args.keep)
            runs += run_user_commands(ws)
    except PreflightFailed as err:
        log.error("preflight: %s", err)
        print(f"PREFLIGHT FAILED: {err}")
    else:
        text, totals = report(ws, runs, _pod(args, full), device)
        print(text)
    if ws is not None:
        print(f"workspace: {ws.root}")
    print(result_line(bool(totals), time.perf_counter() - t0, runs, totals, device))
    return 0 if totals else 1


def memory_forecast(args: argparse.Namespace) -> int:
    """``--memory``: each training phase's peak GPU memory at full size (by default the phases that train beside a
    frozen denoiser — adapters, ControlNets — when the configuration has some, else every phase), measured on fake
    tensors (:mod:`sdforge.preflight.phase_memory`); printed as a table and a JSON line; no DAG runs, nothing is
    written."""
    try:
        params = parse_params(read_params(Path(args.params), overlays(args.overlay)), origin=args.params)
    except PreflightFailed as err:
        print(f"PREFLIGHT FAILED: {err}")
        return 1
    phases = args.phase or frozen_base_phases(params) or forecast_phases(params)
    unknown = [p for p in phases if p not in params.phases]
    if unknown:
        print(f"PREFLIGHT FAILED: --memory: no phase {unknown} (the configuration's: {params.phase_names()})")
        return 1
    refused = {p: unmodelled(params, p) for p in phases if unmodelled(params, p)}
    if refused:
        print(f"PREFLIGHT FAILED: --memory does not forecast {refused}")
        return 1
    t0 = time.perf_counter()
    rows = memory_rows([measure_setup(params, phase) for phase in phases], args.budget_gib)
    print(memory_table(rows, args.budget_gib))
    print(json.dumps({"memory": rows}))
    print(f"RESULT name=preflight_memory ok=true phases={len(rows)} family={params.models.denoiser.family} "
          f"wall_s={time.perf_counter() - t0:.0f} device=fake-cpu")  # fmt: skip
    return 0


def read_params(path: Path, overlays: list[Path] = ()) -> dict[str, Any]:
    """The params file with ``overlays`` merged in (mappings key by key: an optional phase such as
    configs/full/distill.yaml's), once it validates (a :class:`PreflightFailed` naming the key otherwise)."""
    try:
        data = yaml.safe_load(path.read_text())
        for overlay in overlays:
            data = merged(data, yaml.safe_load(overlay.read_text()))
        with tempfile.TemporaryDirectory() as tmp:  # validated as the workspace will read it
            (Path(tmp) / "params.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
            load_params(Path(tmp) / "params.yaml")
        return data
    except (ConfigError, OSError) as err:
        raise PreflightFailed(f"params: {err}") from None


def overlays(given: list[str] | None) -> list[Path]:
    """``--overlay``'s files: the default overlay when none is given, nothing for ``none``."""
    names = [DEFAULT_OVERLAY] if given is None else [g for g in given if g != "none"]
    return [Path(n) for n in names]


def _shrink(args: argparse.Namespace, device: str) -> Shrink:
    return Shrink(
        steps=args.steps, batch_size=args.batch_size, grad_accum=args.grad_accum, nproc=args.nproc,
        cpus=os.cpu_count() or 1, device=device,
    )


def _pod(args: argparse.Namespace, full: dict) -> Pod:
    train = full.get("train", {})
    gpus = args.gpus or int(train.get("nproc_per_node", 1)) * int(train.get("nnodes", 1))
    return Pod(
        gpus=gpus, train_img_s=args.train_img_s, encode_img_s=args.encode_img_s, fetch_img_s=args.fetch_img_s,
        price_per_gpu_hour=args.price_per_gpu_hour,
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``sdforge preflight`` options."""
    pod = Pod()
    parser.add_argument("--params", default="configs/full/params.yaml", help="the configuration to rehearse")
    parser.add_argument("--overlay", action="append", default=None, metavar="YAML",
                        help=f"merge this file into --params (repeatable; default {DEFAULT_OVERLAY}: the optional "
                             "phases the full run may add are rehearsed too); --overlay none: no overlay")  # fmt: skip
    parser.add_argument(
        "--out", default=".preflight", help="scratch workspace: new, empty or a previous preflight's (replaced)"
    )
    parser.add_argument("--samples", type=int, default=2, help="items per source (more where a phase needs more)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sample images and captions")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps per phase")
    parser.add_argument("--batch-size", type=int, default=None, help="per-process batch (default: 1 on CPU)")
    parser.add_argument("--grad-accum", type=int, default=None, help="accumulation (default: 1 on CPU)")
    parser.add_argument("--nproc", type=int, default=1, help="training processes (default 1)")
    parser.add_argument("--eval-all", action="store_true", help="eval every phase (default: the last one)")
    parser.add_argument("--keep", action="store_true", help="keep every run dir and checkpoint (~20 GB a phase)")
    parser.add_argument("--gpus", type=int, default=None, help="pod GPUs to project for (default: the config's)")
    parser.add_argument("--train-img-s", type=float, default=pod.train_img_s, help="per GPU (assumed)")
    parser.add_argument("--encode-img-s", type=float, default=pod.encode_img_s, help="per GPU (assumed)")
    parser.add_argument("--fetch-img-s", type=float, default=pod.fetch_img_s, help="per pod (assumed)")
    parser.add_argument("--price-per-gpu-hour", type=float, default=pod.price_per_gpu_hour, help="USD (assumed)")
    parser.add_argument("--memory", action="store_true",
                        help="forecast each training phase's peak GPU memory at full size instead (the adapter "
                             "and ControlNet phases, or every phase when there are none; no DAG, no weights: the real "
                             "architectures on fake tensors, ~1-4 min a phase; docs/SDXL.md, docs/MMDIT.md, "
                             "docs/CONTROL.md)")  # fmt: skip
    parser.add_argument("--phase", action="append", default=None, help="with --memory: only these phases")
    parser.add_argument("--budget-gib", type=float, nargs="+", default=[16.0, 24.0],
                        help="with --memory: the card sizes to fit (GiB; default 16 24)")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """``python -m tools.preflight`` (the same as ``sdforge preflight``)."""
    parser = argparse.ArgumentParser(prog="sdforge preflight", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parser.parse_args(argv)
    return memory_forecast(args) if args.memory else preflight(args)


if __name__ == "__main__":
    sys.exit(main())
