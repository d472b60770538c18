"""The validation loss during training: the EMA weights on the phase's held-out samples (``train.held_out``,
split off by ``mix_phase``), every ``train.val_loss_every`` steps and at the phase's end.

Each held-out sample keeps one noise tensor for the whole run, seeded from ``train.seed`` and its (source, key),
and is noised at the same ``train.val_loss_timesteps`` fixed levels (:mod:`model.held_out_loss`), so every
measurement of a phase — and of any phase at the same resolution — sees identical inputs. The EMA weights are
swapped in and back out exactly and no global RNG is drawn, so a run with the validation loss trains
bit-identically to one without. It runs on the main rank; the others wait for it in the next step.

Reported per source (``val_loss.<source>``), per level (``val_loss.t<fraction>``) and overall (``val_loss``):
in the step record, as MLflow step metrics, and at the end as ``final_val_loss*`` with its cost
(``val_loss_seconds``, ``val_loss_measurements``). docs/EVAL.md.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch

from model.denoisers import family
from model.held_out_loss import fixed_fractions, held_out_losses
from model.precision import uses_bf16_autocast
from model.speed import attention_context
from sdforge.config import Params
from sdforge.control.reader import ConditionReader, condition_reader
from sdforge.io import held_out_path
from sdforge.latents.loader import LatentIndexDataset
from sdforge.latents.sizes import SizeReader, size_reader
from sdforge.training.conditioning import Conditioning
from sdforge.training.hooks import Hook
from sdforge.training.sharded_state import shard_like

log = logging.getLogger(__name__)


def sample_noise_seed(seed: int, source: str, key: str) -> int:
    """The seed of one held-out sample's noise: stable across phases, processes and machines."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{source}/{key}".encode()).digest()[:8], "little") >> 1


class HeldOutLoss:
    """The held-out samples of one phase, in fixed batches (one bucket each) with their fixed noise."""

    def __init__(self, data: LatentIndexDataset, keys: list[str], seed: int, points: int, batch_size: int,
                 controls: ConditionReader | None = None, sizes: SizeReader | None = None):  # fmt: skip
        self.data, self.fractions = data, fixed_fractions(points)
        self.controls = controls
        """A ControlNet phase's held-out conditioning images: each sample's loss is measured under its own."""
        self.sizes = sizes
        """A micro-conditioned family's held-out image sizes: each sample's loss is measured under its own."""
        self.batches: list[np.ndarray] = []
        for bucket in range(len(data.buckets)):
            positions = np.flatnonzero(data.sample_bucket == bucket)
            self.batches += [positions[i : i + batch_size] for i in range(0, len(positions), batch_size)]
        shapes = {b: data.latent_shapes[b] for b in range(len(data.buckets))}
        self.noise = [
            torch.stack([
                torch.randn(shapes[int(data.sample_bucket[p])], generator=torch.Generator().manual_seed(
                    sample_noise_seed(seed, data.sources[data.source_code[p]], keys[p])))
                for p in batch.tolist()
            ])
            for batch in self.batches
        ]  # fmt: skip

    @classmethod
    def for_phase(cls, params: Params, phase_name: str) -> HeldOutLoss | None:
        """The phase's held-out set from ``<phase>.held_out.parquet``; None when it has no sample."""
        path = held_out_path(Path(params.paths.mixes) / f"{phase_name}.parquet")
        if params.train.held_out == 0 or not path.is_file():
            return None
        keys = pq.read_table(path, columns=["key"]).column("key").to_pylist()
        if not keys:
            return None
        data = LatentIndexDataset(path, Path(params.paths.latents), params.phase_resolution(phase_name))
        cfg = params.train
        sizes = size_reader(family(params.models.denoiser.family).micro_conditioning, data,
                            Path(params.paths.latents), params.phase_resolution(phase_name))  # fmt: skip
        return cls(data, keys, cfg.seed, cfg.val_loss_timesteps, cfg.val_loss_batch,
                   condition_reader(params, phase_name, data), sizes)  # fmt: skip

    def measure(self, job, weights: list[torch.Tensor] | None = None) -> dict[str, float]:
        """``val_loss``, ``val_loss.<source>`` and ``val_loss.t<fraction>`` of the job's EMA weights, or of
        ``weights`` (one tensor per trainable parameter); the live weights are put back bit for bit."""
        trainable = job.model.trainable
        job.optim.settle()  # a background checkpoint may still be copying the live weights
        live = [p.detach().clone() for p in trainable]
        _copy_into(trainable, job.optim.ema.shadow_params if weights is None else weights)
        try:
            return self.measure_unet(job.model.unet, job.conditioning, job.objective, job.cfg.mixed_precision,
                                     job.attention)  # fmt: skip
        finally:
            _copy_into(trainable, live)

    def measure_unet(self, unet, conditioning: Conditioning, objective: str, mixed_precision: str = "no",
                     attention=None) -> dict[str, float]:  # fmt: skip
        """The figures of :meth:`measure` for ``unet`` as it is (any weights: another phase's, a rebuilt EMA), on
        ``conditioning``'s device; ``unet`` is left in train mode."""
        dev = conditioning.device
        bf16 = uses_bf16_autocast(dev, mixed_precision)
        unet.eval()
        try:
            with torch.no_grad(), attention_context(attention), conditioning.evaluating():
                losses = torch.cat([self._batch_losses(unet, conditioning, objective, bf16, b)
                                    for b in range(len(self.batches))]).cpu()  # fmt: skip
        finally:
            unet.train()
        return self._summary(losses.double())

    def _batch_losses(self, unet, conditioning: Conditioning, objective: str, bf16: bool, b: int) -> torch.Tensor:
        latents, input_ids = self.data.gather(self.batches[b])
        dev = conditioning.device
        cond = conditioning.encode(input_ids)
        if self.sizes is not None:
            cond = conditioning.text.family.sized(cond, self.sizes.gather(self.batches[b]).to(dev))
        control = contextlib.nullcontext()
        if self.controls is not None:
            control = unet.conditioned(self.controls.gather(self.batches[b]).to(dev))
        with control, torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16):
            return held_out_losses(unet, latents.to(dev), cond, self.noise[b].to(dev), self.fractions,
                                   objective=objective, scheduler=conditioning.scheduler)  # fmt: skip

    def _summary(self, losses: torch.Tensor) -> dict[str, float]:
        order = np.concatenate(self.batches)
        codes = torch.from_numpy(self.data.source_code[order].astype(np.int64))
        out = {"val_loss": float(losses.mean())}
        for code, source in enumerate(self.data.sources):
            mine = losses[codes == code]
            if mine.numel():
                out[f"val_loss.{source}"] = float(mine.mean())
        for k, fraction in enumerate(self.fractions.tolist()):
            out[f"val_loss.t{fraction:.2f}"] = float(losses[:, k].mean())
        return out


@torch.no_grad()
def _copy_into(params: list[torch.nn.Parameter], tensors: list[torch.Tensor]) -> None:
    """``tensors`` into ``params``: whole tensors (a rebuilt EMA) into a sharded model's shards too."""
    for p, t in zip(params, tensors, strict=True):
        p.copy_(shard_like(t, p))


class ValLossHook(Hook):
    """Measures :class:`HeldOutLoss` on the main rank (every rank with a sharded model) every ``train.val_loss_every``
    steps and at the last step,
    puts it on the step's report (``report.metrics``) and, at the end, into the phase's metrics."""

    def __init__(self, params: Params, phase_name: str):
        self.params, self.phase_name = params, phase_name
        self.every = params.train.val_loss_every
        self.held_out: HeldOutLoss | None = None
        self.last: tuple[int, dict] | None = None
        self.seconds, self.measurements = 0.0, 0

    def start(self, job) -> None:
        if job.dist.is_main or job.model.sharded:  # a sharded model's forward is collective: every rank measures
            self.held_out = HeldOutLoss.for_phase(self.params, self.phase_name)
            if self.held_out is not None:
                log.info("validation loss: %d held-out samples x %d levels, every %s step(s) and at the end",
                         len(self.held_out.data), len(self.held_out.fractions), self.every or "no")  # fmt: skip

    def due(self, step: int, total: int) -> bool:
        """Whether optimizer step ``step`` of ``total`` is measured."""
        return step == total or (self.every > 0 and step % self.every == 0)

    def busy_after(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def after_step(self, job, report) -> None:
        if self.held_out is not None and self.due(report.step, job.plan.total_steps):
            report.metrics.update(self._measure(job, report.step))

    def end(self, job) -> None:
        step = job.state.progress.step
        if self.held_out is not None and (self.last is None or self.last[0] != step):
            self._measure(job, step)  # a run resumed after its last step: the end is still measured

    def _measure(self, job, step: int) -> dict:
        start = time.perf_counter()
        with job.busy("val_loss"):
            metrics = self.held_out.measure(job)
        self.seconds += time.perf_counter() - start
        self.measurements += 1
        self.last = (step, metrics)
        log.info("step %d: val_loss %.5f (%.1f s)", step, metrics["val_loss"], time.perf_counter() - start)
        return metrics

    def finish(self, job, metrics: dict) -> None:
        if self.last is None:
            return
        metrics.update({f"final_{k}": round(v, 6) for k, v in self.last[1].items()})
        metrics.update(val_loss_seconds=round(self.seconds, 2), val_loss_measurements=self.measurements,
                       val_loss_samples=len(self.held_out.data))  # fmt: skip
