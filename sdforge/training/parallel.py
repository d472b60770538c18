"""``train.parallel``: whether the ranks replicate the model (DDP) or shard it (FSDP2), and why (docs/PARALLEL.md).

``auto`` shards only where replication would not leave room for the batch: on CUDA, when the replicated training
state (fp32 weights, gradients, AdamW's two moments and the EMA: 20 bytes per parameter) would take more than half
the card. A CPU run, and a single process, replicate (nothing to share the state with).
"""

from __future__ import annotations

import logging
import secrets
import socket
from pathlib import Path

import torch

from sdforge.io import InputError
from sdforge.training.distributed import Dist

log = logging.getLogger(__name__)

STATE_BYTES_PER_PARAM = 4 + 4 + 8 + 4
"""fp32 weights, gradients, AdamW's two moments, the EMA's shadow weights."""
BATCH_SHARE = 0.5
"""``auto`` shards once the replicated state takes more than ``1 - BATCH_SHARE`` of the card."""


def replicated_state_bytes(n_params: int) -> int:
    """The training state every rank holds under DDP (before activations)."""
    return n_params * STATE_BYTES_PER_PARAM


def choose_sharding(setting: str, n_params: int, dist: Dist, blockers: list[str]) -> bool:
    """Whether this run shards its model: ``setting`` is ``train.parallel``; ``blockers`` are the keys of the phase
    that sharding does not support (``Params.fsdp_blockers``): an InputError naming them under ``fsdp``, a
    replicated run under ``auto``. The choice and its reason are logged."""
    if setting == "fsdp" and blockers:
        raise InputError(
            f"train.parallel: fsdp does not support {', '.join(blockers)} yet (docs/PARALLEL.md): set "
            "train.parallel: ddp or auto (auto replicates such a phase), or drop those settings for this phase"
        )
    if setting != "auto":
        return setting == "fsdp"
    state = replicated_state_bytes(n_params)
    if dist.device.type != "cuda" or dist.world == 1:
        log.info("train.parallel auto: ddp (%s)", "a CPU run" if dist.device.type != "cuda" else "one process")
        return False
    card = torch.cuda.get_device_properties(dist.device).total_memory
    if state <= (1 - BATCH_SHARE) * card:
        log.info("train.parallel auto: ddp (the replicated state, %.1f GiB, leaves %.0f %% of the %.0f-GiB card for "
                 "the batch)", state / 2**30, 100 * (1 - state / card), card / 2**30)  # fmt: skip
        return False
    if blockers:
        log.warning("train.parallel auto: ddp although the replicated state (%.1f GiB) takes %.0f %% of the card: "
                    "fsdp does not support %s yet", state / 2**30, 100 * state / card, ", ".join(blockers))  # fmt: skip
        return False
    log.info("train.parallel auto: fsdp (the replicated state, %.1f GiB, would take %.0f %% of the %.0f-GiB card; "
             "sharded over %d ranks: %.1f GiB each)", state / 2**30, 100 * state / card, card / 2**30, dist.world,
             state / dist.world / 2**30)  # fmt: skip
    return True


def ensure_process_group(dist: Dist) -> None:
    """A process group for sharding on one process (torchrun starts one only for several)."""
    if torch.distributed.is_initialized():
        return
    store = torch.distributed.HashStore()
    backend = "nccl" if dist.device.type == "cuda" else "gloo"
    torch.distributed.init_process_group(backend, store=store, rank=0, world_size=1)


def require_shared_folder(folder: Path, dist: Dist) -> None:
    """Every rank of a sharded run writes its own shards into the run dir ``folder``, and every rank reads them all
    back on a resume (and on another world size): an InputError on every rank naming the ranks (and hosts) that do
    not see a file the main rank just wrote there — a multi-node run whose nodes each have their own ``paths.runs``.
    A collective; nothing to check for one process."""
    if dist.world == 1:
        return
    token = [secrets.token_hex(8) if dist.is_main else None]
    probe = Path(folder) / f".shared-probe-{token[0]}" if dist.is_main else None
    if dist.is_main:
        Path(folder).mkdir(parents=True, exist_ok=True)
        probe.write_text(socket.gethostname())
    torch.distributed.broadcast_object_list(token, src=0)  # after the write: the probe is there for every rank
    probe = Path(folder) / f".shared-probe-{token[0]}"
    seen = [None] * dist.world
    torch.distributed.all_gather_object(seen, (probe.is_file(), socket.gethostname()))
    if dist.is_main:
        probe.unlink()
    blind = [f"{rank} on {host}" for rank, (ok, host) in enumerate(seen) if not ok]
    if blind:
        raise InputError(
            f"train.parallel: fsdp writes every rank's shards into the run dir {folder}, and rank(s) "
            f"{', '.join(blind)} do not see it (a node's own disk?): put paths.runs on storage every node mounts "
            "(on the cluster: cluster.work_pvc, a ReadWriteMany claim), or set train.parallel: ddp"
        )
