"""``python -m tools.cluster`` — the Kubernetes side, from params (docs/CLUSTER.md).

- ``check``: the mistakes that would only show on the cluster (:mod:`sdforge.cluster.checks`), by key; exit 2.
- ``render --out DIR``: every manifest the project can produce, as YAML — the work pool's base job template, the
  Job each deployment of ``deploy/kubernetes/prefect.yaml`` gets, and each phase's training job (for
  ``kubectl apply --dry-run=server -f DIR``, or to read).
- ``work-pool``: check, then create (or update) the Prefect work pool from the template with params' defaults.
- ``deploy``: ``prefect deploy --all`` from ``deploy/kubernetes/prefect.yaml`` with ``SDFORGE_ROOT`` the image's repo.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from sdforge.cluster.checks import ClusterConfigError, check_cluster
from sdforge.cluster.manifests import training_job
from sdforge.cluster.work_pool import pool_template, render_flow_job
from sdforge.config import ConfigError, parse_params, read_yaml_bounded
from sdforge.io import setup_logging

log = logging.getLogger("sdforge.cluster")
REPO = Path(__file__).resolve().parents[1]
DEPLOYMENTS = REPO / "deploy" / "kubernetes" / "prefect.yaml"
POOL = "gpu-pods"


def deployments(path: Path = DEPLOYMENTS) -> dict[str, dict]:
    """Each cluster deployment's name → its work pool ``job_variables``."""
    data = yaml.safe_load(path.read_text())
    return {d["name"]: dict(d["work_pool"].get("job_variables") or {}) for d in data["deployments"]}


def render_all(data: dict) -> dict[str, list[dict]]:
    """File name → the manifests in it: the pool template, one Job per deployment, one training job per phase."""
    params = parse_params(data)
    template = pool_template(params)
    out = {"work-pool-template.yaml": [template]}
    for name, variables in deployments().items():
        out[f"flow-job-{name}.yaml"] = [render_flow_job(template, variables, flow_run_name=f"{name}-run")]
    for phase in params.phases:
        out[f"train-job-{phase}.yaml"] = training_job(data, phase)
    return out


def _write(out_dir: Path, rendered: dict[str, list[dict]]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, docs in rendered.items():
        (out_dir / name).write_text(yaml.safe_dump_all(docs, sort_keys=False))
        log.info("wrote %s (%d object(s))", out_dir / name, len(docs))


def _work_pool(data: dict, name: str) -> int:
    with tempfile.TemporaryDirectory(prefix="sdforge-pool-") as tmp:
        template = Path(tmp) / "base-job-template.json"
        template.write_text(json.dumps(pool_template(parse_params(data)), indent=2))
        cmd = ["prefect", "work-pool", "create", name, "--type", "kubernetes", "--base-job-template", str(template),
               "--overwrite"]  # fmt: skip
        log.info("%s", " ".join(cmd))
        return subprocess.run(cmd, check=False).returncode


def _deploy(data: dict) -> int:
    env = {**os.environ, "SDFORGE_ROOT": parse_params(data).cluster.repo_dir}
    cmd = ["prefect", "deploy", "--prefect-file", str(DEPLOYMENTS), "--all", "--no-prompt"]
    return subprocess.run(cmd, env=env, cwd=REPO, check=False).returncode


def main(argv: list[str] | None = None) -> int:
    """CLI entry; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m tools.cluster", description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=["check", "render", "work-pool", "deploy"])
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--out", type=Path, default=Path("cluster-manifests"), help="render: the folder written")
    parser.add_argument("--pool", default=POOL, help="work-pool: its name")
    args = parser.parse_args(argv)
    setup_logging()
    try:
        data = read_yaml_bounded(Path(args.params))
        check_cluster(parse_params(data))
    except (ClusterConfigError, ConfigError, OSError) as err:
        log.error("%s: %s", args.params, err)
        return 2
    if args.command == "check":
        log.info("%s: ready for the cluster", args.params)
        return 0
    if args.command == "render":
        _write(args.out, render_all(data))
        return 0
    return _work_pool(data, args.pool) if args.command == "work-pool" else _deploy(data)


if __name__ == "__main__":
    sys.exit(main())
