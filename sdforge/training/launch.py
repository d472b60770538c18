"""Run a stage under ``torchrun`` when ``train.nproc_per_node`` or ``train.nnodes`` asks for several processes.

The stage's entry calls :func:`needs_launch`; if true it re-executes itself as
``python -m torch.distributed.run ... -m stages.<stage> <argv>`` (:func:`torchrun_command`) and
waits (:func:`launch`). The launcher does no training and writes nothing: rank 0 of the job
exports the weights, writes the metrics JSON and logs to MLflow, as it would without torchrun.

Signals: torchrun runs in its own session, so a terminal's Ctrl-C reaches it once, through the
launcher, which forwards SIGTERM/SIGINT to its process group (torchrun forwards them to the
ranks). On Linux the child also gets SIGTERM if the launcher dies (``PR_SET_PDEATHSIG``), so a
``kill -9`` of ``dvc repro`` leaves no orphaned ranks holding GPUs.
"""

from __future__ import annotations

import ctypes
import logging
import math
import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence

from sdforge.config import Train

log = logging.getLogger(__name__)

TORCHRUN_ENV = ("RANK", "LOCAL_RANK")
"""Set by torchrun in every rank: their presence means "already launched"."""
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT)
SHUTDOWN_MARGIN_S = 10
"""torchrun's ``--shutdown_timeout`` is ``train.preempt_grace_s`` plus this."""
NODE_RANK_ENV = "SDFORGE_NODE_RANK"
"""This node's rank, overriding ``train.node_rank``: a Kubernetes training job sets it from the pod's index."""
TRAIN_JOB_ENV = "SDFORGE_TRAIN_JOB"
"""Set in a training job's pods (the job's name): the stage runs torchrun there instead of submitting a job."""


def node_rank(cfg: Train, env: Mapping[str, str]) -> int:
    """``SDFORGE_NODE_RANK`` if set (a pod of a training job), else ``train.node_rank``."""
    value = env.get(NODE_RANK_ENV)
    if value is None:
        return cfg.node_rank
    if not value.isdigit() or int(value) >= cfg.nnodes:
        raise ValueError(f"{NODE_RANK_ENV}={value!r}: not a node rank below train.nnodes {cfg.nnodes}")
    return int(value)


def needs_launch(cfg: Train, env: Mapping[str, str]) -> bool:
    """True when the config asks for several processes and this one is not already a torchrun rank."""
    wants_many = cfg.nproc_per_node > 1 or cfg.nnodes > 1
    return wants_many and not any(k in env for k in TORCHRUN_ENV)


def torchrun_command(
    cfg: Train, argv: Sequence[str], module: str = "stages.train", env: Mapping[str, str] | None = None
) -> list[str]:
    """``torchrun ... -m module argv``: c10d rendezvous if an endpoint is set, else --standalone; the node rank
    from :func:`node_rank` (``env``: default ``os.environ``)."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(cfg.nproc_per_node),
        "--nnodes",
        str(cfg.nnodes),
        "--node_rank",
        str(node_rank(cfg, os.environ if env is None else env)),
        # after SIGTERM torchrun waits this long for the ranks (stopping at a step boundary, checkpointing)
        # before SIGKILL; its default, 30 s, would cut a preemption checkpoint short
        "--shutdown_timeout",
        str(math.ceil(cfg.preempt_grace_s) + SHUTDOWN_MARGIN_S),
    ]
    if cfg.rdzv_endpoint:
        cmd += ["--rdzv_backend", "c10d", "--rdzv_endpoint", cfg.rdzv_endpoint]
    else:
        cmd += ["--standalone"]
    return [*cmd, "-m", module, *argv]


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def launch(cmd: Sequence[str], env: Mapping[str, str] | None = None) -> int:
    """Run ``cmd`` in its own process group, forwarding SIGTERM/SIGINT to it; return a shell-style status.

    0 on success, the child's exit code on failure, ``128 + N`` if it died of signal N.
    """
    log.info("launching: %s", " ".join(cmd))
    child = subprocess.Popen(
        list(cmd), env=dict(env) if env is not None else None, start_new_session=True, preexec_fn=_die_with_parent
    )

    def forward(signum, _frame):
        log.warning("launcher got signal %d; forwarding it to torchrun (pid %d)", signum, child.pid)
        try:
            os.killpg(child.pid, signum)
        except ProcessLookupError:
            pass

    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED_SIGNALS}
    try:
        rc = child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 128 - rc if rc < 0 else rc
