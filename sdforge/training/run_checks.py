"""What the train stage checks around a run: the facts every rank must agree on before step 0, and the
sample ledger's audit and per-source figures at the end (docs/RESILIENCE.md)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pyarrow.parquet as pq

from sdforge.config import Params
from sdforge.latents.bucket_batches import plan_epochs
from sdforge.training.ledger import audit, caption_summary, read_ledger, source_summary
from sdforge.training.trainer import Trainer
from sdforge.training.watchdog import fingerprint

log = logging.getLogger(__name__)


def rank_facts(params: Params, tr: Trainer, fp: str) -> dict:
    """What every rank must agree on before step 0 (:func:`sdforge.training.watchdog.check_ranks_agree`)."""
    per_epoch = [len(plan.micro_batches(tr.dist.rank, tr.split)) for plan in epoch_plans(tr)]
    if os.environ.get("SDFORGE_FAULT_EXTRA_BATCH_RANK") == str(tr.dist.rank):  # fault injection (tests)
        per_epoch[0] += 1
    config = params.model_dump(mode="json")
    config["train"].pop("node_rank", None)
    return {
        "micro_batches_per_epoch": per_epoch,
        "split": [tr.split.micro, tr.split.accum, tr.split.world],
        "resume_step": tr.progress.step,
        "data": fingerprint([len(tr.data), tr.data.buckets, tr.data.sources, fp]),
        "config": fingerprint(config),
    }


def epoch_plans(tr: Trainer):
    """The plan of every epoch of the phase (its global batches), at the run's global batch."""
    return plan_epochs(tr.data.sample_bucket, tr.phase.epochs, tr.cfg.seed, tr.split.global_batch, tr.cfg.bucket_tail)


def ledger_metrics(tr: Trainer, run_dir: Path, out_dir: Path) -> dict:
    """The ledger's audit (exactly-once per epoch), per-source counts, losses, realised vs planned mix and caption
    mix (``caption.<source>.synthetic`` …);
    the whole ledger is written to ``out_dir/ledger.parquet`` beside the exported weights."""
    ledger = read_ledger(run_dir, tr.ledger_segments)
    pq.write_table(ledger, out_dir / "ledger.parquet", compression="zstd")
    phase = tr.phase
    planned = {k: (v / phase.samples if phase.mix_is_counts else v) for k, v in phase.mix.items()}
    figures = audit(ledger, list(epoch_plans(tr)), tr.epoch_lengths)
    if figures["ledger.duplicates"] or figures["ledger.missing"] or figures["ledger.unplanned"]:
        log.error("train@%s: the sample ledger is not exactly-once: %s", tr.phase_name, figures)
    captions = caption_summary(ledger, tr.data.has_synthetic, phase.synthetic_share)
    return {**figures, **source_summary(ledger, planned), **captions}
