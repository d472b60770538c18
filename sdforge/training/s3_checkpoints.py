"""Mirror a phase's checkpoints to S3 (boto3) and fetch the newest back on a fresh pod.

Remote layout, one folder per run (:func:`run_url`: the phase and its input fingerprint,
:mod:`sdforge.training.inputs`): ``<checkpoint_s3>/<phase>/<fingerprint>/checkpoint-<step:08d>/<same files as
on disk>``, and the sample ledger's segments under ``<…>/<fingerprint>/ledger/`` (uploaded before the checkpoint
that lists them, fetched with it; :mod:`sdforge.training.ledger`). A run moved aside locally keeps its remote
folder untouched: nothing of it is overwritten or pruned by the run that replaced it. The endpoint is boto3's
own: ``AWS_ENDPOINT_URL`` (or
``AWS_ENDPOINT_URL_S3``) if set, else AWS.

Upload protocol (:meth:`RemoteRun.upload`): delete whatever is under the checkpoint's prefix
(``COMPLETE`` first), upload every file (multipart above ``multipart_threshold``), then the ``COMPLETE``
manifest *last* — so a listing only ever sees complete uploads, and a partial one (killed pod) is
ignored. Pruning deletes ``COMPLETE`` first for the same reason; the rule is the local one
(:func:`sdforge.training.checkpoints.retained`) applied to the remote manifests. A download is verified against
its manifest (sizes + sha256) in a temp dir before it is renamed into the run dir.

:class:`BackgroundUploader` runs uploads on one worker thread (in order) from hard-linked snapshots,
so training neither waits for the network nor races local pruning; :meth:`BackgroundUploader.close`
waits for what is pending. ``SDFORGE_CHECKPOINT_UPLOAD=sync`` uploads inline (tests, fault injection).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sdforge.training.checkpoints import (
    COMPLETE,
    POSTHOC_DIR,
    PREFIX,
    CheckpointError,
    Retention,
    retained,
    verify_checkpoint,
)
from sdforge.training.ledger import LEDGER_DIR

log = logging.getLogger(__name__)

MULTIPART_THRESHOLD = 64 * 2**20


def split_s3_url(url: str) -> tuple[str, str]:
    """``s3://bucket/a/b`` → ``("bucket", "a/b")`` (no trailing slash)."""
    if not url.startswith("s3://") or len(url) <= 5:
        raise ValueError(f"expected an s3://bucket/prefix URL; got {url!r}")
    bucket, _, prefix = url[5:].partition("/")
    return bucket, prefix.strip("/")


def run_url(checkpoint_s3: str, phase: str, fingerprint: str) -> str:
    """The remote folder of one run: ``<checkpoint_s3>/<phase>/<input fingerprint>`` (a run from other inputs
    has its own folder: it never resumes from, overwrites or prunes another run's copies)."""
    return f"{checkpoint_s3.rstrip('/')}/{phase}/{fingerprint}"


@dataclass(frozen=True)
class RemoteCheckpoint:
    name: str
    step: int
    manifest: dict[str, Any]
    url: str


class RemoteRun:
    """The checkpoints of one run under ``s3_url`` (``s3://bucket/prefix/<phase>``)."""

    def __init__(self, s3_url: str, client: Any = None, multipart_threshold: int = MULTIPART_THRESHOLD):
        # lazy: boto3 (~0.5 s) only when train.checkpoint_s3 is set
        import boto3
        from boto3.s3.transfer import TransferConfig

        self.url = s3_url.rstrip("/")
        self.bucket, self.prefix = split_s3_url(s3_url)
        self.s3 = client or boto3.client("s3")
        self.transfer = TransferConfig(multipart_threshold=multipart_threshold, multipart_chunksize=multipart_threshold)

    def _key(self, *parts: str) -> str:
        return "/".join(p for p in (self.prefix, *parts) if p)

    def _keys(self, prefix: str) -> list[str]:
        pages = self.s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)
        return [obj["Key"] for page in pages for obj in page.get("Contents", [])]

    def _delete(self, keys: list[str]) -> None:
        for i in range(0, len(keys), 1000):
            batch = [{"Key": k} for k in keys[i : i + 1000]]
            self.s3.delete_objects(Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True})

    def _delete_checkpoint(self, name: str) -> None:
        marker = self._key(name, COMPLETE)
        self.s3.delete_object(Bucket=self.bucket, Key=marker)
        self._delete([k for k in self._keys(self._key(name) + "/") if k != marker])

    def complete(self) -> list[RemoteCheckpoint]:
        """Remote checkpoints whose ``COMPLETE`` manifest is present and parses, oldest first."""
        found = []
        for key in self._keys(self._key(PREFIX)):
            name, _, rest = key[len(self._key()) :].lstrip("/").partition("/")
            if rest != COMPLETE or not name.removeprefix(PREFIX).isdigit():
                continue
            try:
                body = self.s3.get_object(Bucket=self.bucket, Key=key)["Body"].read()
                manifest = json.loads(body)
                manifest["files"]  # noqa: B018 - a manifest must list its files
            except Exception as err:  # noqa: BLE001 - an unreadable marker is not a checkpoint
                log.warning("s3://%s/%s: unreadable manifest (%s); ignored", self.bucket, key, err)
                continue
            found.append(RemoteCheckpoint(name, int(name.removeprefix(PREFIX)), manifest, f"{self.url}/{name}"))
        return sorted(found, key=lambda c: c.step)

    def newest(self) -> RemoteCheckpoint | None:
        done = self.complete()
        return done[-1] if done else None

    def upload(self, ckpt: Path, name: str | None = None) -> str:
        """Upload the checkpoint dir ``ckpt`` (as ``name``, default its own): files, then ``COMPLETE``."""
        name = name or ckpt.name
        if not (ckpt / COMPLETE).is_file():
            raise CheckpointError(f"{ckpt}: no {COMPLETE} marker; not uploading an incomplete checkpoint")
        self._delete_checkpoint(name)  # a stale or partial upload of the same step
        files = sorted(p for p in ckpt.rglob("*") if p.is_file() and p.name != COMPLETE)
        for path in [*files, ckpt / COMPLETE]:
            key = self._key(name, path.relative_to(ckpt).as_posix())
            self.s3.upload_file(str(path), self.bucket, key, Config=self.transfer)
        log.info("uploaded %s to %s/%s (%d files)", ckpt, self.url, name, len(files) + 1)
        return f"{self.url}/{name}"

    def download(self, remote: RemoteCheckpoint, run_dir: Path) -> Path:
        """Fetch ``remote`` into ``run_dir/<name>`` (temp dir, verified against its manifest, renamed)."""
        final = run_dir / remote.name
        tmp = run_dir / f"{remote.name}.download"
        shutil.rmtree(tmp, ignore_errors=True)
        for rel in [*remote.manifest["files"], COMPLETE]:
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            self.s3.download_file(self.bucket, self._key(remote.name, rel), str(tmp / rel), Config=self.transfer)
        try:
            verify_checkpoint(tmp)
        except CheckpointError:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        self.download_ledger(remote.manifest.get("ledger", []), run_dir)
        self.download_snapshots(run_dir, remote.step)
        return final

    def upload_ledger(self, segment: Path) -> None:
        """Upload one ledger segment (``<run dir>/ledger/<name>``) to ``<run>/ledger/<name>``."""
        self.upload_side(LEDGER_DIR, segment)

    def upload_side(self, folder: str, path: Path) -> None:
        """Upload a run-dir side file (a ledger segment, a post-hoc EMA snapshot) to ``<run>/<folder>/<name>``."""
        self.s3.upload_file(str(path), self.bucket, self._key(folder, path.name), Config=self.transfer)

    def download_snapshots(self, run_dir: Path, up_to_step: int) -> int:
        """Fetch the post-hoc EMA snapshots (``<run>/posthoc/step-NNNNNNNN.safetensors``) of steps ≤ ``up_to_step``
        that ``run_dir/posthoc/`` lacks; how many. A failed one is a warning: the phase then exports the fixed EMA
        and counts it (``posthoc_ema.missing_snapshots``)."""
        fetched = 0
        for key in self._keys(self._key(POSTHOC_DIR) + "/"):
            name = key.rsplit("/", 1)[-1]
            target = run_dir / POSTHOC_DIR / name
            if target.is_file() or not name.startswith("step-") or int(name[5:13]) > up_to_step:
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_suffix(".download")
            try:
                self.s3.download_file(self.bucket, key, str(tmp), Config=self.transfer)
            except Exception as err:  # noqa: BLE001 - a missing snapshot must not stop a resume
                log.warning("post-hoc EMA snapshot %s/%s not fetched (%s)", self.url, key, err)
                continue
            os.replace(tmp, target)
            fetched += 1
        return fetched

    def download_ledger(self, entries: list[dict], run_dir: Path) -> None:
        """Fetch the listed ledger segments that ``run_dir`` lacks; one missing remotely is a warning (the
        ledger then has a gap the stage's audit reports; training is unaffected)."""
        folder = run_dir / LEDGER_DIR
        folder.mkdir(parents=True, exist_ok=True)
        for entry in entries:
            target = folder / entry["name"]
            if target.is_file():
                continue
            tmp = folder / f".{entry['name']}.tmp"
            try:
                self.s3.download_file(self.bucket, self._key(LEDGER_DIR, entry["name"]), str(tmp), Config=self.transfer)
            except Exception as err:  # noqa: BLE001 - a ledger gap must not stop a resume
                log.warning("ledger segment %s/%s/%s not fetched (%s)", self.url, LEDGER_DIR, entry["name"], err)
                continue
            os.replace(tmp, target)

    def prune(self, retention: Retention, fingerprint: str | None = None) -> list[str]:
        """Apply ``retention`` to the remote checkpoints of ``fingerprint`` (all if None); a checkpoint from other
        inputs is never deleted here (removing a stale run is the user's call)."""
        done = self.complete()
        ours = [c for c in done if fingerprint is None or c.manifest.get("fingerprint") == fingerprint]
        keep = retained({c.step: c.manifest.get("loss") for c in ours}, retention)
        dropped = [c.name for c in ours if c.step not in keep]
        for name in dropped:
            self._delete_checkpoint(name)
        if dropped:
            log.info("pruned %s from %s", ", ".join(dropped), self.url)
        return dropped


class BackgroundUploader:
    """Upload each new checkpoint (then prune the remote) on one worker thread, in order."""

    def __init__(self, remote: RemoteRun, run_dir: Path, retention: Retention, sync: bool | None = None):
        self.remote, self.retention = remote, retention
        self.spool = run_dir / ".upload"
        shutil.rmtree(self.spool, ignore_errors=True)  # snapshots of a killed run: their originals decide
        self.sync = os.environ.get("SDFORGE_CHECKPOINT_UPLOAD") == "sync" if sync is None else sync
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="s3-upload")
        self.pending: list[Future] = []
        self.failed = 0
        self.uploaded_segments: set[str] = set()

    def submit(self, ckpt: Path, ledger: list[Path] | tuple = (), snapshots: list[Path] | tuple = ()) -> None:
        """Snapshot ``ckpt``, the ``ledger`` segments and the post-hoc EMA ``snapshots`` not uploaded yet (hard links;
        copies where links fail) and queue their upload: side files first, then the checkpoint that lists them."""
        snap = self.spool / ckpt.name
        shutil.rmtree(snap, ignore_errors=True)
        try:
            shutil.copytree(ckpt, snap, copy_function=os.link)
        except OSError:
            shutil.rmtree(snap, ignore_errors=True)
            shutil.copytree(ckpt, snap)
        segments = []
        for folder, path in [*((LEDGER_DIR, p) for p in ledger), *((POSTHOC_DIR, p) for p in snapshots)]:
            if f"{folder}/{path.name}" in self.uploaded_segments:
                continue
            copy = self.spool / f"{snap.name}.{folder}" / path.name
            copy.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(path, copy)
            except OSError:
                shutil.copy2(path, copy)
            segments.append(copy)
        future = self.pool.submit(self._upload, snap, segments)
        self.pending.append(future)
        if self.sync:
            future.result()

    def _upload(self, snap: Path, segments: list[Path] = ()) -> None:
        try:
            for segment in segments:
                folder = segment.parent.name.removeprefix(f"{snap.name}.")
                self.remote.upload_side(folder, segment)
                self.uploaded_segments.add(f"{folder}/{segment.name}")
            self.remote.upload(snap)
            fingerprint = json.loads((snap / COMPLETE).read_text()).get("fingerprint")
            self.remote.prune(self.retention, fingerprint)
        except Exception as err:  # noqa: BLE001 - a failed upload must not stop training; local copy stays
            self.failed += 1
            log.error("upload of %s to %s failed (%s); the local checkpoint is kept", snap.name, self.remote.url, err)
        finally:
            shutil.rmtree(snap, ignore_errors=True)
            for folder in (LEDGER_DIR, POSTHOC_DIR):
                shutil.rmtree(self.spool / f"{snap.name}.{folder}", ignore_errors=True)

    def close(self) -> None:
        """Wait for every pending upload."""
        if self.pending:
            log.info(
                "waiting for %d checkpoint upload(s) to %s", sum(not f.done() for f in self.pending), self.remote.url
            )
        self.pool.shutdown(wait=True)
        if self.failed:
            log.error("%d checkpoint upload(s) to %s failed; see above", self.failed, self.remote.url)
