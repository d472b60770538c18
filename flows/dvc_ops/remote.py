"""The DVC remote on S3: configure it from params, push a finished stage, restore one on a fresh clone.

    python -m flows.dvc_ops.remote configure          # from params.yaml storage:; prints `remote NAME` or `none`
    python -m flows.dvc_ops.remote push STAGE         # the stage's outputs + its run-cache entry
    python -m flows.dvc_ops.remote sync-run-cache     # the remote's run-cache entries (small files) to .dvc/cache
    python -m flows.dvc_ops.remote restore STAGE      # prints pulled / current / absent

Credentials never pass through here: DVC (s3fs/botocore) takes them from the standard AWS chain
(environment, ~/.aws, the pod's role). The remote goes into ``.dvc/config.local`` (git-ignored), so a
fresh clone gets it from ``params.yaml`` by running ``configure`` (the flows do that first). A default
remote set otherwise (``dvc remote add -d --local``, e.g. by ``tools.stack up --with-s3``) is used too.

Why the run cache: a pod that dies takes its ``dvc.lock`` with it, so a fresh clone knows no output
hashes. DVC's run cache is keyed by a stage's command, deps and params, which a clone has; pushing it
with each stage lets a clone find that stage's outputs again. ``dvc push --run-cache`` (DVC 3.67)
uploads the entry and the workspace outputs but not the objects of ``cache: false`` outputs (the
metrics JSONs) that the entry lists — without them ``dvc repro --pull`` reruns the stage — so
:func:`push_stage` uploads those objects too. :func:`restore_stage` does what ``dvc repro --pull``
does for one stage, without running it: pull the lock's outputs if the lock still matches, else
check out the run-cache entry's outputs (the following ``dvc repro --single-item`` then reports
"is cached - skipping run" and writes the lock).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from sdforge.config import Storage, load_params

RESTORE_STATUSES = ("current", "pulled", "absent")
"""``current``: outputs up to date, nothing to do; ``pulled``: outputs downloaded from the remote;
``absent``: the remote has nothing for this stage's inputs (it will run)."""


def _dvc(root: Path, *args: str) -> None:
    env = {**os.environ, "DVC_NO_ANALYTICS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "dvc", *args], cwd=root, env=env, text=True, capture_output=True,
        stdin=subprocess.DEVNULL,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"dvc {' '.join(args)} exited {proc.returncode}: {proc.stdout}{proc.stderr}".strip())


def configure_remote(root: str | Path, storage: Storage) -> bool:
    """Make ``storage.dvc_remote`` the default DVC remote of ``root`` in ``.dvc/config.local``.

    Returns False (and changes nothing) when no remote is configured. Idempotent.
    """
    if not storage.dvc_remote:
        return False
    root = Path(root)
    name = storage.remote_name
    _dvc(root, "remote", "add", "--local", "--force", "--default", name, storage.dvc_remote)
    if storage.endpoint_url:
        _dvc(root, "remote", "modify", "--local", name, "endpointurl", storage.endpoint_url)
    return True


def default_remote(root: str | Path) -> str | None:
    """The name of the default DVC remote of ``root`` (from any config level), else None."""
    # lazy: DVC's API (~1 s); needed only when a remote is configured
    from dvc.repo import Repo

    with Repo(str(root)) as repo:
        return repo.config["core"].get("remote")


def _stage(repo, target: str):
    stages = repo.stage.collect(target)
    if len(stages) != 1:
        raise KeyError(f"{target!r} names {len(stages)} stages; expected exactly one")
    return stages[0]


def push_stage(root: str | Path, target: str, attempts: int = 2) -> int:
    """Push ``target``'s outputs, its run-cache entry and its uncached outputs' objects; return files sent.

    Then ``dvc status -c`` of the stage: after an interrupted push DVC 3.67 can report the next one
    complete with objects still missing (docs/KILL-HARNESS.md), so it pushes again while the remote
    lacks any (up to ``attempts`` pushes; then it raises, and the Prefect task retries).
    """
    # lazy: DVC's API (~1 s); needed only when a remote is configured
    from dvc.repo import Repo

    with contextlib.chdir(root), Repo(str(root)) as repo:  # DVC resolves targets against the cwd
        sent = 0
        for _ in range(attempts):
            sent += repo.push(targets=[target], run_cache=True)
            missing = repo.status(targets=[target], cloud=True)
            if not missing:
                break
        else:
            raise RuntimeError(f"{target}: still missing on the remote after {attempts} pushes: {missing}")
        stage = _stage(repo, target)
        if not _run_cacheable(stage):
            _commit_uncached_outs(repo, stage)
        uncached = [o.hash_info for o in stage.outs if not o.use_cache and o.hash_info]
        if uncached:
            result = repo.cloud.push(uncached)
            if result.failed:
                raise RuntimeError(f"{target}: {len(result.failed)} uncached output object(s) failed to push")
            sent += len(result.transferred)
        sent += _push_lock_entry(repo, stage)
    return sent


LOCKS_DIR = "sdforge-locks"
"""Remote folder of the ``dvc.lock`` entries of stages DVC's run cache skips (one JSON per stage)."""


def _run_cacheable(stage) -> bool:
    """Whether DVC's run cache takes ``stage`` (it refuses stages with ``persist: true`` outputs)."""
    # lazy: DVC's API (~1 s); needed only when a remote is configured
    from dvc.stage.cache import _can_hash

    return bool(_can_hash(stage))


def _lock_entry_path(repo, stage) -> tuple[object, str]:
    remote = repo.cloud.get_remote()
    return remote.fs, remote.fs.join(remote.path, LOCKS_DIR, f"{stage.addressing}.json")


def _commit_uncached_outs(repo, stage) -> None:
    """Put ``stage``'s ``cache: false`` outputs (metrics) into the local cache so they can be pushed.

    DVC does this itself only when it saves a run-cache entry; for a stage it keeps out of the run cache
    it is done here, the way ``StageCache.save`` does it (a copy, through a stage built from the lock).
    """
    # lazy: DVC's API (~1 s); needed only when a remote is configured
    from dvc.stage.serialize import to_single_stage_lockfile

    uncached = {o.def_path for o in stage.outs if not o.use_cache}
    if not uncached:
        return
    cache_stage = repo.stage_cache._create_stage(to_single_stage_lockfile(stage), wdir=stage.wdir)
    with repo.stage_cache._cache_type_copy():
        for out in cache_stage.outs:
            if out.def_path in uncached and out.is_in_repo:
                out.commit()


def _push_lock_entry(repo, stage) -> int:
    """Upload ``stage``'s ``dvc.lock`` entry when the run cache cannot stand in for it; return files sent.

    DVC 3.67 keeps stages with ``persist: true`` outputs (every stage whose outputs a source or phase names:
    dvc.yaml's header says why) out of its run cache, so on a fresh clone without the dead pod's ``dvc.lock``
    nothing would tell DVC that their pushed outputs match the clone's inputs. The entry (cmd, deps,
    params and output hashes) does; :func:`_restore_lock_entry` puts it back. The newest push of a
    stage wins.
    """
    # lazy: DVC's API (~1 s); needed only when a remote is configured
    from dvc.stage.serialize import to_single_stage_lockfile

    if _run_cacheable(stage) or not all(o.hash_info for o in stage.outs):
        return 0
    fs, path = _lock_entry_path(repo, stage)
    fs.makedirs(fs.parent(path), exist_ok=True)
    fs.pipe_file(path, json.dumps(to_single_stage_lockfile(stage), indent=1).encode())
    return 1


def _restore_lock_entry(root: Path, target: str) -> bool:
    """Merge the remote's ``dvc.lock`` entry of a non-run-cacheable stage into ``dvc.lock``, pull its outputs.

    True if the entry matched the clone's cmd, deps and params and its outputs were checked out; else
    ``dvc.lock`` is left as it was.
    """
    # lazy: DVC's API (~1 s); needed only when a remote is configured
    from dvc.exceptions import CheckoutError

    # lazy: DVC's API (~1 s); needed only when a remote is configured
    from dvc.repo import Repo, lock_repo

    with contextlib.chdir(root), Repo(str(root)) as repo:  # DVC resolves targets against the cwd
        stage = _stage(repo, target)
        if _run_cacheable(stage):
            return False
        fs, path = _lock_entry_path(repo, stage)
        if not fs.exists(path):
            return False
        entry = json.loads(fs.cat_file(path))
        name = stage.addressing
    lockfile = root / "dvc.lock"
    before = lockfile.read_bytes() if lockfile.is_file() else None
    data = (yaml.safe_load(before) if before else None) or {"schema": "2.0", "stages": {}}
    data.setdefault("stages", {})[name] = entry
    lockfile.write_text(yaml.safe_dump(data, sort_keys=False))
    with contextlib.chdir(root), Repo(str(root)) as repo, lock_repo(repo):
        stage = _stage(repo, target)
        if not stage.changed(allow_missing=True):  # same cmd, deps and params as the pushed run
            # as DVC's StageCache.restore does: a stage built from the entry treats every output as
            # cached, so the objects pushed for ``cache: false`` metrics are pulled and checked out too
            pushed = repo.stage_cache._create_stage(entry, wdir=stage.wdir)
            try:
                for objs in pushed.get_used_objs().values():
                    repo.cloud.pull(objs)
                if pushed.outs_cached():
                    pushed.checkout()
                    return True
            except CheckoutError:
                pass
    if before is None:
        lockfile.unlink()
    else:
        lockfile.write_bytes(before)
    return False


def sync_run_cache(root: str | Path) -> int:
    """Download the remote's run-cache entries (``runs/``; no data); return how many."""
    # lazy: DVC's API (~1 s); needed only when a remote is configured
    from dvc.repo import Repo

    with Repo(str(root)) as repo:
        return len(repo.stage_cache.pull(None))


def restore_stage(root: str | Path, target: str) -> str:
    """Bring ``target``'s outputs from the remote if its inputs match what was pushed; see RESTORE_STATUSES."""
    # lazy: DVC's API (~1 s); needed only when a remote is configured
    from dvc.exceptions import CheckoutError

    # lazy: DVC's API (~1 s); needed only when a remote is configured
    from dvc.repo import Repo, lock_repo

    # lazy: DVC's API (~1 s); needed only when a remote is configured
    from dvc.stage.cache import RunCacheNotFoundError

    # lock_repo is re-entrant: pull and checkout take it again
    with contextlib.chdir(root), Repo(str(root)) as repo, lock_repo(repo):
        stage = _stage(repo, target)
        if not stage.changed():
            return "current"
        if not stage.changed(allow_missing=True):  # the lock matches; only its data is missing
            try:
                repo.pull(stage.addressing)
                stage.checkout()
                return "pulled"
            except CheckoutError:
                pass
        try:
            repo.stage_cache.restore(stage, pull=True)
            return "pulled"
        except RunCacheNotFoundError:
            pass
    return "pulled" if _restore_lock_entry(Path(root), target) else "absent"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("command", choices=["configure", "push", "sync-run-cache", "restore"])
    ap.add_argument("stage", nargs="?")
    ap.add_argument("--params", default="params.yaml")
    args = ap.parse_args(argv)
    root = Path.cwd()
    if args.command in ("push", "restore") and not args.stage:
        ap.error(f"{args.command} needs a STAGE")
    if args.command == "configure":
        configure_remote(root, load_params(root / args.params).storage)
        remote = default_remote(root)
        print(f"remote {remote}" if remote else "none")
    elif args.command == "push":
        print(f"{push_stage(root, args.stage)} file(s) pushed")
    elif args.command == "sync-run-cache":
        print(f"{sync_run_cache(root)} run-cache entries")
    else:
        print(restore_stage(root, args.stage))
    return 0


if __name__ == "__main__":
    sys.exit(main())
