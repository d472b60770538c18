"""The train stage's command line, ``python -m stages.train --params params.yaml --item <phase>``: where it trains.

- ``cluster.enabled`` with ``train.nnodes > 1`` (and not inside a training job's pod): submit the phase as a
  Kubernetes training job and wait (:mod:`sdforge.cluster.train_job`);
- ``train.nproc_per_node > 1`` or ``nnodes > 1``, not yet a torchrun rank: re-execute the stage under
  ``torchrun`` (:mod:`sdforge.training.launch`; NCCL on CUDA, gloo on CPU) and turn the ranks' exit markers
  back into the stage's exit status;
- otherwise train here: rank 0 through the stage's ``run_stage`` (metrics JSON, MLflow), other ranks through
  its ``run`` (nothing written once per job).

A preempted run exits with status 75, a hung one with 76 (:mod:`sdforge.training.exits`): the flow retries
those, resuming from the newest checkpoint. The command line is parsed once.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from sdforge.cluster.train_job import run_cluster_stage, submits_job
from sdforge.config import ConfigError, Params, load_params
from sdforge.io import InputError, run_stage_command, setup_logging, stage_args
from sdforge.training.exits import PREEMPTED, read_marker
from sdforge.training.launch import launch, needs_launch, torchrun_command
from sdforge.training.preemption import Preempted

log = logging.getLogger(__name__)

StageRun = Callable[[Params, str], dict]


def train_cli(argv: list[str] | None, run: StageRun, run_stage: StageRun) -> None:
    """Run the train stage for the command line ``argv`` (default ``sys.argv[1:]``), where the params say."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = stage_args("train", argv)
    params = _readable_params(args.params)  # None: the stage run below reports the error, status 2
    if params is not None and submits_job(params, os.environ):
        raise SystemExit(run_cluster_stage(Path(args.params), args.item))
    if params is not None and needs_launch(params.train, os.environ):
        return _under_torchrun(params, args, argv)
    try:
        if int(os.environ.get("RANK", "0")) == 0:
            run_stage_command("train", run_stage, args.params, args.item)
        else:
            _other_rank(run, args)
    except Preempted as stop:
        log.warning("train@%s: %s; exiting with status %d (rerunning, or the flow's retry, resumes from the newest "
                    "checkpoint)", args.item, stop, PREEMPTED)  # fmt: skip
        raise SystemExit(PREEMPTED) from None


def _readable_params(path: str) -> Params | None:
    try:
        return load_params(path)
    except (ConfigError, OSError, ValueError):
        return None


def _other_rank(run: StageRun, args: argparse.Namespace) -> None:
    """A non-zero rank: train, but leave the metrics JSON (and everything else written once) to rank 0."""
    setup_logging()
    try:
        run(load_params(args.params), args.item)
    except (ConfigError, InputError) as err:
        log.error("%s", err)
        raise SystemExit(2) from None


def _under_torchrun(params: Params, args: argparse.Namespace, argv: list[str]) -> None:
    """Run this stage under torchrun; a non-zero status fails the stage with that status (a rank's exit marker
    — preempted, hung — gives it back to the orchestrator)."""
    setup_logging()
    cfg, phase = params.train, args.item
    started = time.time()
    rc = launch(torchrun_command(cfg, argv, module="stages.train"))
    marker = read_marker(Path(params.paths.runs) / phase, started) if rc != 0 else None
    if marker:
        status, info = marker
        log.warning("train@%s: the ranks stopped with status %d (%s); rerunning resumes", phase, status, info)
        raise SystemExit(status)
    if rc != 0:
        log.error(
            "train@%s: torchrun (%d node(s) x %d process(es)) exited with status %d; the failing rank's error "
            "is above. Checkpoints in the run dir are kept: rerunning resumes.",
            phase, cfg.nnodes, cfg.nproc_per_node, rc,
        )  # fmt: skip
        raise SystemExit(rc)
    log.info("train@%s: torchrun finished (rank 0 exported the weights and metrics)", phase)
