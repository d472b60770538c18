"""One rank's training job of a phase, assembled from its components: the data, the frozen conditioning, the
trained model (:mod:`~sdforge.training.trained_model`), the optimization (:mod:`~sdforge.training.optimization`),
the plan and the train state (:mod:`~sdforge.training.state`). Hooks and the checkpoint manager read it; the
step (:mod:`~sdforge.training.step`) advances it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import resource
from pathlib import Path

import torch

from model.activation_memory import checkpoint_units, set_checkpointing
from model.denoisers import family
from model.quantization import held_bytes
from model.speed import CUDA_ONLY, attention_backends, deterministic_attention
from sdforge.config import Params
from sdforge.control.reader import condition_reader
from sdforge.io import InputError
from sdforge.latents.loader import LatentIndexDataset, caption_choice
from sdforge.latents.sizes import size_reader
from sdforge.training.conditioning import Conditioning, set_kernel_policy
from sdforge.training.distributed import Dist
from sdforge.training.memory_plan import (
    MemoryPlan,
    budget_bytes,
    cap_device_memory,
    plan_memory,
    rank_state_bytes,
)
from sdforge.training.model_setup import build_trained_model
from sdforge.training.optimization import Optimization
from sdforge.training.state import Plan, TrainState
from sdforge.training.static_step import StaticStep, static_step
from sdforge.training.watchdog import fingerprint

log = logging.getLogger(__name__)


def vae_factor(data: LatentIndexDataset) -> int:
    """How many pixels a latent spans per side: the first bucket's width over its latents' width."""
    return max(1, data.buckets[0][0] // int(data.latent_shapes[0][-1])) if data.buckets else 8


class JobEvents:
    """What a job tells its listeners: long operations (:meth:`busy`) and an abrupt end (:meth:`abort`)."""

    def __init__(self):
        self.busy_listeners: list = []
        """Told when a long operation (checkpoint, validation) starts and ends: ``listener(name, started)``."""
        self.abort_listeners: list = []
        """Told why, when the process is about to end without unwinding (the hang watchdog): ``listener(why)``."""

    @contextlib.contextmanager
    def busy(self, name: str):
        """Around a long operation on this rank (a checkpoint write, validation sampling): listeners (the hang
        watchdog) allow it more time."""
        for listener in self.busy_listeners:
            listener(name, True)
        try:
            yield
        finally:
            for listener in self.busy_listeners:
                listener(name, False)

    def abort(self, why: str) -> None:
        """The process ends now without unwinding (``os._exit``): tell the abort listeners (MLflow: KILLED)."""
        for listener in self.abort_listeners:
            try:
                listener(why)
            except Exception:  # noqa: BLE001 - the exit must happen whatever a report does
                log.exception("abort listener failed")


class TrainJob(JobEvents):
    """The components of one phase's training on one rank."""

    def __init__(self, params: Params, phase_name: str, dist: Dist):
        super().__init__()
        self.params, self.phase_name, self.dist = params, phase_name, dist
        self.phase, self.cfg = params.phases[phase_name], params.train
        set_kernel_policy(self.cfg, dist.device)
        paths = params.paths
        index = Path(paths.mixes) / f"{phase_name}.parquet"
        self.data = LatentIndexDataset(index, Path(paths.latents), params.phase_resolution(phase_name))
        self.family = family(params.models.denoiser.family)
        self.conditioning = Conditioning(Path(paths.models), dist.device, self.cfg.text_encoder_dtype, self.family)
        self.caption_parts = self.conditioning.caption_parts(self.phase.caption_dropout)
        """``phases.<p>.caption_dropout`` as ``(part, rate)`` pairs (none: only ``cfg_dropout``'s whole prompt)."""
        self.objective = params.phase_objective(phase_name)
        words = self.phase.adapter.words if self.phase.adapter is not None else []
        learned = self.conditioning.learn_words(words, f"phases.{phase_name}.adapter.words")
        text_lora = self.conditioning.adapt_text_encoders(self.phase.adapter)
        blockers = tuple(params.fsdp_blockers(phase_name))
        cap_device_memory(self.cfg, dist.device)  # a budget on CUDA is a hard limit: a smaller card, emulated
        largest = max(self.data.latent_shapes.values(), key=lambda shape: shape[-1] * shape[-2], default=None)
        self.model = build_trained_model(params, self.phase, dist, len(self.data.buckets), learned, blockers,
                                         tuple(largest[-2:]) if largest else None, vae_factor(self.data),
                                         text_lora)  # fmt: skip
        self.controls = condition_reader(params, phase_name, self.data)
        """A ControlNet phase's conditioning images, read beside the latents (None for any other phase)."""
        self.sizes = size_reader(self.family.micro_conditioning, self.data, Path(paths.latents),
                                 params.phase_resolution(phase_name))  # fmt: skip
        """Each sample's size and crop for a family with micro-conditioning (None for the others)."""
        self.memory: MemoryPlan | None = None
        self.attention = attention_backends(self._attention_choice(dist), dist.device)
        where = f"phases.{phase_name}.optimizer"
        self.optim = Optimization(self.model.trainable, self.phase, self.cfg, dist.device, where, self.model.unet)
        self.set_global_batch(self.phase.batch_size * self.phase.grad_accum * dist.world)
        self.state = TrainState(self.cfg.seed, dist.rank)
        self.static: StaticStep | None = static_step(self)
        """``train.cuda_graphs: step``'s buffers and graphs (None: the eager step)."""

    def side_input_metrics(self) -> dict:
        """A ControlNet phase's samples that trained under an empty map (no condition was made for them); a
        micro-conditioned family's samples and how many had a known original size."""
        control = {} if self.controls is None else {"controlnet.missing_conditions": self.controls.missing}
        return {**control, **({} if self.sizes is None else self.sizes.metrics())}

    def release_training_memory(self) -> None:
        """Free what only training needs — the optimizer's moments, the gradients, a static step's buffers and
        graphs — before the phase's export (no memory beyond training's)."""
        if self.static is not None:
            self.static.release(self)
            self.static = None
        self.optim.release()

    def _attention_choice(self, dist: Dist) -> str:
        """``train.attention``, or ``math`` for ``auto`` under ``train.deterministic`` on CUDA (logged)."""
        choice = deterministic_attention(self.cfg.attention, self.cfg.deterministic, dist.device)
        if choice != self.cfg.attention:
            log.info("train.deterministic on CUDA: attention %s -> %s (flash/efficient backward is not "
                     "deterministic; set train.attention to override)", self.cfg.attention, choice)  # fmt: skip
        elif self.cfg.deterministic and choice in CUDA_ONLY and dist.device.type == "cuda":
            log.warning("train.deterministic with train.attention=%s: that kernel's backward may not be "
                        "deterministic, so a resumed run may not repeat the uninterrupted one bit for bit; "
                        "attention: math (or auto) does", choice)  # fmt: skip
        return choice

    def set_global_batch(self, global_batch: int) -> None:
        """Plan the phase for ``global_batch`` samples per step (a fresh run's, or the resumed run's): this job's
        split of it (within the memory plan: :mod:`sdforge.training.memory_plan`), the steps per epoch, the LR
        schedule (a SplitError if it does not split)."""
        self.memory = self._memory_plan(max(1, global_batch // self.dist.world))
        self.plan = Plan.build(self.data, self.phase, self.phase_name, self.cfg, self.dist.world, global_batch,
                               self.memory.micro)  # fmt: skip
        self.optim.plan(self.plan.total_steps)

    def _memory_plan(self, per_rank: int) -> MemoryPlan:
        """``train.activation_checkpointing`` for this rank's share of the global batch, set on the model and
        logged."""
        cfg, model = self.cfg, self.model
        units = list(checkpoint_units(model.unet))
        state = rank_state_bytes(model, cfg, self.optim.posthoc is not None)
        plan = plan_memory(cfg.activation_checkpointing, units, model.activation_profile, state,
                           budget_bytes(cfg, self.dist.device), per_rank, self.phase.batch_size)  # fmt: skip
        set_checkpointing(model.unet, list(plan.checkpointed))
        if cfg.activation_checkpointing != "off":
            log.info("train.activation_checkpointing %s", plan.why)
        return plan

    def memory_metrics(self) -> dict:
        """The memory plan's choice and what the phase held: its models' weights as stored (``weights_mib``: the
        denoiser and text encoders, adapters and quantised layers included), this process's peak RSS, and on CUDA
        the peak allocated memory."""
        plan = self.memory
        out = {"memory.checkpointed_units": len(plan.checkpointed), "memory.micro_batch_cap": plan.micro}
        if plan.peak_bytes is not None:
            out["memory.forecast_peak_gib"] = round(plan.peak_bytes / 2**30, 2)
        modules = [self.model.unet, *self.conditioning.text.encoders]
        held = sum(held_bytes(t) for m in modules for t in (*m.parameters(), *m.buffers()))
        out["memory.weights_mib"] = round(held / 2**20, 3)
        out["memory.peak_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
        if self.dist.device.type == "cuda":
            out["memory.peak_cuda_gib"] = round(torch.cuda.max_memory_allocated(self.dist.device) / 2**30, 3)
        return out

    def check_plan(self) -> None:
        """An InputError naming the keys when the phase has no optimizer step at its global batch."""
        if self.plan.total_steps:
            return
        data, name = self.data, self.phase_name
        sizes = {f"{w}x{h}": int((data.sample_bucket == b).sum()) for b, (w, h) in enumerate(data.buckets)}
        raise InputError(
            f"train@{name}: no optimizer step: every aspect bucket holds fewer samples than the global "
            f"batch {self.plan.global_batch} (samples per bucket: {sizes}); lower phases.{name}.batch_size "
            f"or grad_accum, train on fewer ranks, or give the phase more samples (phases.{name}.samples)"
        )

    def caption_choice(self, epoch: int):
        """Per index position: the sample trains with its synthetic caption in ``epoch`` (``caption_mix``)."""
        return caption_choice(self.data, self.cfg.seed, epoch, self.phase.synthetic_share)

    def rank_facts(self, inputs_fingerprint: str) -> dict:
        """What every rank must agree on before step 0 (:func:`sdforge.training.watchdog.check_ranks_agree`)."""
        epochs = self.plan.all_epochs(self.data)
        per_epoch = [len(plan.micro_batches(self.dist.rank, self.plan.split)) for plan in epochs]
        if os.environ.get("SDFORGE_FAULT_EXTRA_BATCH_RANK") == str(self.dist.rank):  # fault injection (tests)
            per_epoch[0] += 1
        config = self.params.model_dump(mode="json")
        config["train"].pop("node_rank", None)
        split = self.plan.split
        return {
            "micro_batches_per_epoch": per_epoch,
            "split": [split.micro, split.accum, split.world],
            "resume_step": self.state.progress.step,
            "data": fingerprint([len(self.data), self.data.buckets, self.data.sources, inputs_fingerprint]),
            "config": fingerprint(config),
        }
