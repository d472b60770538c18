"""Kill harness: SIGKILL the demo DAG at random points, rerun, and check that nothing was lost or redone.

``python -m tools.kill_harness --kills 20 --seed 0`` clones this repository (``git clone`` of
HEAD) into a temp dir, shrinks ``params.yaml`` with the end-to-end test's profile
(``tools.tiny_demo.shrink``: 2 phases at 2 resolutions, 96 + 48 images, 30 VAE steps, a few training steps,
checkpoint every 3 steps, written in the background: ``train.async_checkpoint: on``) and

1. runs ``dvc repro`` once uninterrupted (the reference) and records per-stage durations and hashes;
2. in a second clone, runs ``dvc repro`` in its own session again and again, each time killing the
   whole process group (SIGKILL) at the next kill point, until the DAG completes: a kill point
   is a stage type (``fetch_images``, ``prepare_models``, ``encode_latents``, ``train``,
   ``eval_grid``, ...) hit at a random fraction of that stage's reference duration after DVC
   logs ``Running stage '...'``, or ``checkpoint`` (the moment a ``runs/<phase>/checkpoint-*.tmp``
   directory appears, i.e. inside a checkpoint write), or ``push`` (``dvc push`` to a local
   remote, killed after a random delay, then pushed again). Kill points left when the DAG has
   completed roll over into a fresh clone (an *episode*).

After each episode it checks: no stage that DVC had completed ran again (``Running stage`` for a
stage seen completed in an earlier attempt), the process group is empty after each kill, ``dvc
status`` and ``dvc status -c`` are clean, every retained training checkpoint verifies against its
manifest, every latent shard passes ``check_shard``, and the EMA weights and eval grids equal the
reference byte for byte. The last line is ``RESULT kills=... landed=... corrupt=0 reruns=0
hash_equal=true``.
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from tools.kill_attempt import SPECIAL_TARGETS, dvc_env, run_killable
from tools.kill_checks import (
    Episode,
    Kill,
    checkpoint_problems,
    differing_keys,
    lock_outs,
    result_hashes,
    shard_problems,
    stage_type,
    summarize,
)
from tools.tiny_demo import free_port, shrink, with_recaption

REPO = Path(__file__).resolve().parents[1]
STAGE_TARGETS = (
    "fetch_images",
    "prepare_models",
    "caption_images",
    "encode_latents",
    "train",
    "eval_grid",
    "download_metadata",
    "filter_metadata",
    "mix_phase",
    "make_demo_data",
)
"""Stage types a kill can be aimed at, most interesting first (resumable or long stages)."""
DEFAULT_ROTATION = (
    "fetch_images",
    "prepare_models",
    "encode_latents",
    "train",
    "checkpoint",
    "eval_grid",
    "push",
    "train",
    "checkpoint",
    "mix_phase",
    "filter_metadata",
)


def make_project(dest: Path, port: int, remote: Path | None = None, recaption: bool = False) -> Path:
    """A ``git clone`` of HEAD at ``dest`` with the tiny params (``recaption``: plus a recaptioned source,
    :func:`tools.tiny_demo.with_recaption`) and (optionally) a local DVC remote."""
    subprocess.run(["git", "clone", "-q", "--no-hardlinks", str(REPO), str(dest)], check=True)
    params = shrink(yaml.safe_load((dest / "params.yaml").read_text()), port)
    params = with_recaption(params) if recaption else params
    params["train"]["async_checkpoint"] = "on"  # a `checkpoint` kill lands inside a background write (issue 38)
    (dest / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    if remote is not None:
        _dvc(dest, "remote", "add", "--local", "-d", "harness", str(remote))
    return dest


def _dvc(root: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", "dvc", *args], cwd=root, env=dvc_env(), capture_output=True, text=True, timeout=1800
    )
    if check and proc.returncode != 0:
        out = f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        raise RuntimeError(f"dvc {' '.join(args)} exited {proc.returncode}:\n{out}")
    return proc


# -- checks --------------------------------------------------------------------------------------
def corrupt_artifacts(root: Path) -> list[str]:
    """Problems found: DVC status not clean, a checkpoint failing its manifest, a bad latent shard."""
    sys.path.insert(0, str(REPO))
    return _dvc_status_problems(root) + checkpoint_problems(root) + shard_problems(root)


def _dvc_status_problems(root: Path) -> list[str]:
    """``dvc status`` and ``dvc status -c`` (the remote) not clean, with the start of their output."""
    problems = []
    status = _dvc(root, "status", "--json").stdout.strip()
    if json.loads(status or "{}"):
        problems.append(f"dvc status not clean: {status[:500]}")
    cloud = _dvc(root, "status", "-c", "--json", check=False)
    if cloud.returncode != 0 or json.loads(cloud.stdout.strip() or "{}"):
        problems.append(f"dvc status -c not clean: {(cloud.stdout + cloud.stderr)[:500]}")
    return problems


# -- the harness ---------------------------------------------------------------------------------
def reference(
    workdir: Path, port: int, log, recaption: bool = False
) -> tuple[dict[str, float], dict[str, str], dict[str, str]]:
    root = make_project(workdir / "reference", port, remote=workdir / "reference-remote", recaption=recaption)
    att = run_killable(root, ["repro"], None, random.Random(0), {}, log)
    if att.rc != 0:
        raise RuntimeError("reference dvc repro failed:\n" + "\n".join(att.lines[-60:]))
    durations = dict(att.stage_seconds)
    t = time.monotonic()
    _dvc(root, "push")
    durations["push"] = time.monotonic() - t
    return durations, result_hashes(root), lock_outs(root)


def push_until_in_sync(root: Path, tries: int = 3) -> int:
    """``dvc push`` until ``dvc status -c`` is clean; return how many pushes beyond the first it took.

    After a killed push, the next ``dvc push`` (DVC 3.67) can report success with part of the
    outputs missing from the remote (``dvc status -c`` lists them as ``new``); pushing again fixes it.
    """
    for extra in range(tries):
        _dvc(root, "push")
        if not json.loads(_dvc(root, "status", "-c", "--json").stdout.strip() or "{}"):
            return extra
    raise RuntimeError(f"{root}: remote still not in sync after {tries} pushes")


def run_episode(
    index: int,
    targets: collections.deque,
    workdir: Path,
    port: int,
    rng: random.Random,
    durations: dict[str, float],
    ref_hashes: dict[str, str],
    ref_outs: dict[str, str],
    log,
    recaption: bool = False,
) -> Episode:
    """Run ``dvc repro`` in a fresh clone, killing it at ``targets`` (in order) until the DAG completes, then the
    ``push`` targets; then check the project against the reference. Spent targets are popped from ``targets``."""
    ep = Episode()
    remote = workdir / f"episode{index}-remote"
    root = make_project(workdir / f"episode{index}", port, remote=remote, recaption=recaption)
    completed: set[str] = set()
    done = False
    while not done:
        target = targets[0] if targets else None
        if target == "push":
            target = None  # pushed once the DAG is complete
        att = run_killable(root, ["repro"], target, rng, durations, log)
        ep.attempts += 1
        ep.reruns += [s for s in att.ran if s in completed]
        completed.update(att.completed)
        if att.killed_in is not None:
            targets.popleft()
            ep.kills.append(Kill(index, target, att.killed_in, att.killed_at_s, len(att.leftover_pids)))
            log(f"### kill {target!r} landed in {att.killed_in} after {att.killed_at_s} s")
            continue
        if att.rc != 0:
            raise RuntimeError(f"episode {index}: dvc repro exited {att.rc}:\n" + "\n".join(att.lines[-60:]))
        done = True
    _kill_pushes(ep, index, root, workdir / f"episode{index}-remote", targets, rng, durations, log)
    _dvc(root, "push")
    final = run_killable(root, ["repro"], None, rng, durations, log)
    ep.reruns += final.ran
    ep.corrupt = corrupt_artifacts(root)
    hashes = result_hashes(root)
    ep.hash_diff = differing_keys(ref_hashes, hashes)
    outs = lock_outs(root)
    ep.lock_diff = differing_keys(ref_outs, outs)
    return ep


def _kill_pushes(
    ep: Episode,
    index: int,
    root: Path,
    remote: Path,
    targets: collections.deque,
    rng: random.Random,
    durations: dict[str, float],
    log,
) -> None:
    """Spend the ``push`` targets at the front of ``targets``: a full push to the emptied ``remote``, killed,
    then pushed until in sync. Gives up after 5 pushes that finished before their kill point."""
    misses = 0
    while targets and targets[0] == "push" and misses < 5:
        shutil.rmtree(remote, ignore_errors=True)  # an empty remote: a full push
        att = run_killable(root, ["push"], "push", rng, durations, log)
        if att.killed_in is None:
            log("### push finished before its kill point; emptying the remote and trying again")
            misses += 1
            continue
        targets.popleft()
        ep.kills.append(Kill(index, "push", "push", att.killed_at_s, len(att.leftover_pids)))
        ep.push_repairs.append(push_until_in_sync(root))


def plan(kills: int) -> collections.deque:
    """``kills`` targets, taken round-robin from :data:`DEFAULT_ROTATION` (so every kind is hit)."""
    return collections.deque(DEFAULT_ROTATION[i % len(DEFAULT_ROTATION)] for i in range(kills))


def order_targets(targets: collections.deque, order: list[str]) -> collections.deque:
    """Targets in DAG order (stage types by first appearance in the reference run), ``push`` last."""
    rank = {t: i for i, t in enumerate(dict.fromkeys(stage_type(s) for s in order))}
    rank["checkpoint"] = rank.get("train", 0) + 0.5
    rank["push"] = len(rank) + 1
    return collections.deque(sorted(targets, key=lambda t: rank.get(stage_type(t), 0)))


def kill_target(text: str) -> str:
    """A ``--targets`` entry: a stage type, ``checkpoint``/``push``, or one stage ``type@item``."""
    if text in STAGE_TARGETS + SPECIAL_TARGETS or (stage_type(text) in STAGE_TARGETS and "@" in text):
        return text
    raise argparse.ArgumentTypeError(f"{text!r}: not one of {STAGE_TARGETS + SPECIAL_TARGETS} (or <type>@<item>)")


def _episode_line(number: int, ep: Episode) -> str:
    """The progress line printed after each episode."""
    return (
        f"### episode {number}: {len(ep.kills)} kills, {len(ep.reruns)} reruns, "
        f"{len(ep.corrupt)} corrupt, hash diff {ep.hash_diff}, outs diff {ep.lock_diff}, "
        f"push repairs {ep.push_repairs}"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--targets",
        nargs="*",
        help=f"kill points: stage types, checkpoint, push, or one stage type@item (default: a rotation of "
        f"{DEFAULT_ROTATION})",
        type=kill_target,
    )
    ap.add_argument("--workdir", type=Path, help="keep the projects here (default: a temp dir, deleted)")
    ap.add_argument("--max-episodes", type=int, default=10)
    ap.add_argument("-v", "--verbose", action="store_true", help="echo dvc's output")
    ap.add_argument("--recaption", action="store_true", help="add a recaptioned source (caption_images is a target)")
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    log = print if args.verbose else (lambda line: print(line) if line.startswith(("###", "Running stage")) else None)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="kill-harness-"))
    workdir.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    try:
        print(f"### reference run in {workdir / 'reference'}", flush=True)
        port = free_port()  # one port for all projects: the demo's URLs, hence its metadata, contain it
        durations, ref_hashes, ref_outs = reference(workdir, port, log, args.recaption)
        print(f"### reference stage durations (s): {json.dumps(durations)}", flush=True)
        order = list(durations)
        targets = collections.deque(args.targets) if args.targets else plan(args.kills)
        episodes: list[Episode] = []
        while targets and len(episodes) < args.max_episodes:
            block = order_targets(targets, order)
            before = len(block)
            ep = run_episode(
                len(episodes), block, workdir, port, rng, durations, ref_hashes, ref_outs, log, args.recaption
            )
            episodes.append(ep)
            targets = block
            print(_episode_line(len(episodes) - 1, ep), flush=True)
            if len(block) == before:
                break  # no kill point could be hit (stage too short?)
        report, ok = summarize(episodes, time.monotonic() - start)
        print(report, flush=True)
        return 0 if ok else 1
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
