"""The train stage on the cluster: with ``train.nnodes > 1`` it submits its phase as a training job and waits.

:func:`submits_job` decides (cluster on, several nodes, not already inside a training job's pod);
:func:`run_on_cluster` checks the params (nothing is submitted when a key is wrong), renders the job from the very
params file the stage was given, and runs it (:mod:`sdforge.cluster.job_runner`). Rank 0 of the job writes the
phase's outputs on the shared work claim, where DVC hashes them when the stage returns.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

from sdforge.cluster.checks import check_cluster
from sdforge.cluster.job_runner import ClusterApi, JobFailed, KubernetesApi, run_training_job
from sdforge.cluster.manifests import training_job
from sdforge.config import ConfigError, Params, parse_params, read_yaml_bounded
from sdforge.io import setup_logging
from sdforge.training.launch import TRAIN_JOB_ENV

log = logging.getLogger(__name__)


def submits_job(params: Params, env: Mapping[str, str]) -> bool:
    """True where the stage should submit a training job rather than train or start torchrun itself."""
    return params.cluster.enabled and params.train.nnodes > 1 and TRAIN_JOB_ENV not in env


def run_on_cluster(params_file: Path, phase: str, api: ClusterApi | None = None) -> None:
    """Check, render and run ``phase``'s training job; :class:`~sdforge.cluster.job_runner.JobFailed` if it fails."""
    data = read_yaml_bounded(Path(params_file))
    check_cluster(parse_params(data))
    run_training_job(training_job(data, phase), api or KubernetesApi())


def run_cluster_stage(params_file: Path, phase: str, api: ClusterApi | None = None) -> int:
    """:func:`run_on_cluster` for the stage's CLI: its exit status (0; 2: params wrong, nothing submitted; the
    job's failure status otherwise: 75/76 are resumable, and the flow's retry takes them). Sets up logging."""
    setup_logging()
    try:
        run_on_cluster(params_file, phase, api)
    except ConfigError as err:
        log.error("train@%s: nothing submitted: %s", phase, err)
        return 2
    except JobFailed as err:
        log.error("train@%s: %s", phase, err)
        return err.status
    return 0
