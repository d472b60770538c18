"""The training job of one phase: model, optimizer, LR schedule, EMA, data, and the step loop.

Everything needed to continue bit-exactly is in :meth:`Trainer.state` (saved with the live
weights in each checkpoint); the data order is a pure function of (seed, epoch, global batch), cut over the
ranks by a :class:`~sdforge.latents.bucket_batches.BatchSplit`. The loop stops cleanly on SIGTERM
(:mod:`sdforge.training.preemption`), heartbeats a hang watchdog (:mod:`sdforge.training.watchdog`) and
records every sample it trains on (:mod:`sdforge.training.ledger`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from pathlib import Path

import numpy as np
import torch
from diffusers import DDPMScheduler, UNet2DConditionModel
from safetensors.torch import load_file, save_file
from transformers import CLIPTextModel, CLIPTokenizer

from model.adapters import UNET_GROUPS, add_adapter, count_parameters, lora_config, target_pattern
from model.diffusion import TrainingEMA, build_lr_scheduler, cfg_dropout, denoising_loss
from model.flow_matching import flow_matching_loss
from model.precision import uses_bf16_autocast
from model.sampler import encode_prompts
from sdforge.config import SCRATCH, Adapter, Params, Phase, Train
from sdforge.io import InputError
from sdforge.latents.bucket_batches import plan_epoch
from sdforge.latents.loader import LatentIndexDataset, caption_choice, epochs_summary, iter_batches, rank_batches
from sdforge.training.checkpoints import (
    STATE,
    CheckpointError,
    Progress,
    Retention,
    capture_rng,
    restore_rng,
    rng_path,
    save_checkpoint,
)
from sdforge.training.distributed import Dist, derive_rank_rng, part_generators, step_seeds
from sdforge.training.elastic import choose_split
from sdforge.training.ledger import LEDGER_DIR, LedgerBuffer, keep_only, write_segment
from sdforge.training.optimizers import build_optimizer
from sdforge.training.preemption import Preempted, PreemptionNotice, agree
from sdforge.training.s3_checkpoints import BackgroundUploader, RemoteRun, run_url
from sdforge.training.unet_init import load_foreign_weights, load_init_unet

log = logging.getLogger(__name__)

ADAPTER_DIR, ADAPTER_WEIGHTS = "adapter", "adapter_weights.safetensors"
"""An adapter phase's checkpoint holds the trained tensors only: ``adapter/adapter_weights.safetensors``."""


class Trainer:
    """The phase's model, optimizer, schedule, EMA and data, with checkpoint save/restore."""

    def __init__(self, params: Params, phase_name: str, dist: Dist):
        self.params, self.phase_name, self.dist = params, phase_name, dist
        self.phase: Phase = params.phases[phase_name]
        self.cfg: Train = params.train
        paths, models = params.paths, Path(params.paths.models)
        _allow_tf32(dist.device, self.cfg.tf32)
        if self.cfg.deterministic:
            use_deterministic_kernels()
        index = Path(paths.mixes) / f"{phase_name}.parquet"
        self.data = LatentIndexDataset(index, Path(paths.latents), params.phase_resolution(phase_name))
        self._load_conditioning(models)
        self.objective = params.phase_objective(phase_name)
        self.unet = _load_phase_unet(params, self.phase, dist.device)
        self.trainable = [p for _, p in self.trainable_named()]
        """What the optimizer, gradient clipping and the EMA see: every UNet weight, or the adapter's only."""
        self.model = _wrap_ddp(self.unet, dist)
        self._build_schedule()
        self.ema, self.ema_device = _build_ema(self.unet, self.trainable, self.cfg, dist.device)
        # Same state on every rank: per-sample streams are split off it
        # (sdforge.training.distributed.step_seeds).
        self.generator = torch.Generator().manual_seed(self.cfg.seed * 1000)
        self.progress = Progress()
        self.loss_history: list[float] = []  # a resumed run's last losses before the checkpoint
        self.ledger = LedgerBuffer(dist.rank)
        self.ledger_segments: list[dict] = []
        """The ledger segments of the checkpoint resumed from (then of each one written)."""

    def _load_conditioning(self, models: Path) -> None:
        """The noise scheduler, tokenizer, frozen text encoder and the empty prompt's embedding."""
        device = self.dist.device
        self.scheduler = DDPMScheduler.from_pretrained(models / "scheduler")
        self.tokenizer = CLIPTokenizer.from_pretrained(models / "tokenizer")
        self.text_encoder = _frozen_text_encoder(models, device, self.cfg.text_encoder_dtype)
        self.uncond = _uncond_embedding(models, self.tokenizer, self.text_encoder, device)

    def _build_schedule(self) -> None:
        """The optimizer, and the global batch, step counts and LR schedule of a fresh run."""
        phase = self.phase
        where = f"phases.{self.phase_name}.optimizer"
        self.optimizer = build_optimizer(phase.optimizer, self.trainable, phase.lr, self.cfg, self.dist.device, where)
        self.set_global_batch(phase.batch_size * phase.grad_accum * self.dist.world)

    def set_global_batch(self, global_batch: int) -> None:
        """Plan the phase for ``global_batch`` samples per step (a fresh run's, or the resumed run's):
        this job's split of it, the steps per epoch, the LR schedule (a SplitError if it does not split)."""
        phase = self.phase
        self.split = choose_split(global_batch, phase.batch_size, self.dist.world, self.phase_name)
        self.epoch_lengths, self.bucket_counts = epochs_summary(
            self.data, phase.epochs, self.cfg.seed, global_batch, self.cfg.bucket_tail
        )
        self.total_steps = sum(self.epoch_lengths)
        # none yet when no bucket fills one global batch: a checkpoint may still bring the run's own global
        # batch (another world size); check_plan() refuses to train without steps
        self.lr_scheduler = (
            build_lr_scheduler(self.optimizer, phase.warmup_steps, self.total_steps) if self.total_steps else None
        )

    def check_plan(self) -> None:
        """An InputError naming the keys when the phase has no optimizer step at its global batch."""
        if self.total_steps:
            return
        sizes = {f"{w}x{h}": int((self.data.sample_bucket == b).sum()) for b, (w, h) in enumerate(self.data.buckets)}
        raise InputError(
            f"train@{self.phase_name}: no optimizer step: every aspect bucket holds fewer samples than the global "
            f"batch {self.split.global_batch} (samples per bucket: {sizes}); lower phases.{self.phase_name}.batch_size "
            f"or grad_accum, train on fewer ranks, or give the phase more samples (phases.{self.phase_name}.samples)"
        )

    def epoch_batches(self, epoch: int) -> list:
        """This rank's micro-batches (sample positions) of ``epoch``: :func:`sdforge.latents.loader.rank_batches`."""
        return rank_batches(
            self.data.sample_bucket, epoch, self.cfg.seed, self.dist.rank, self.split, self.cfg.bucket_tail
        )

    def caption_choice(self, epoch: int):
        """Per index position: the sample trains with its synthetic caption in ``epoch`` (``caption_mix``)."""
        return caption_choice(self.data, self.cfg.seed, epoch, self.phase.synthetic_share)

    def epoch_plan(self, epoch: int):
        """The global batches of ``epoch`` (every rank's): :func:`sdforge.latents.bucket_batches.plan_epoch`."""
        return plan_epoch(self.data.sample_bucket, epoch, self.cfg.seed, self.split.global_batch, self.cfg.bucket_tail)

    def trainable_named(self) -> list[tuple[str, torch.nn.Parameter]]:
        """The trained weights by name (all of the UNet's, or the adapter's), in a fixed order."""
        return [(n, p) for n, p in self.unet.named_parameters() if p.requires_grad]

    @property
    def is_adapter(self) -> bool:
        return self.phase.adapter is not None

    def parameter_counts(self) -> dict:
        """``trainable_params`` (what the optimizer updates), ``unet_params`` (the UNet without adapters), share."""
        trainable, base = count_parameters(self.unet)
        return {"trainable_params": trainable, "unet_params": base, "trainable_share": round(trainable / base, 6)}

    # -- checkpoint state ------------------------------------------------------------------
    def write_live_weights(self, ckpt: Path) -> None:
        """The live weights into checkpoint folder ``ckpt``: ``unet/`` (diffusers), or for an adapter phase
        ``adapter/adapter_weights.safetensors`` (the trained tensors by name; the frozen base is the init's)."""
        if not self.is_adapter:
            self.unet.save_pretrained(ckpt / "unet", safe_serialization=True)
            return
        (ckpt / ADAPTER_DIR).mkdir(parents=True)
        tensors = {n: p.detach().cpu().contiguous() for n, p in self.trainable_named()}
        save_file(tensors, ckpt / ADAPTER_DIR / ADAPTER_WEIGHTS)

    def _load_live_weights(self, ckpt: Path) -> None:
        """Inverse of :meth:`write_live_weights`; a CheckpointError naming the folder when they do not fit."""
        if not self.is_adapter:
            live = _checkpoint_unet_weights(ckpt / "unet")
            try:
                self.unet.load_state_dict(live)
            except (RuntimeError, ValueError) as err:
                raise CheckpointError(f"{ckpt / 'unet'}: does not fit this run's UNet ({_first_line(err)})") from err
            return
        path = ckpt / ADAPTER_DIR / ADAPTER_WEIGHTS
        try:
            saved = load_file(path)
        except Exception as err:
            raise CheckpointError(f"{path}: cannot read the adapter weights ({_first_line(err)})") from err
        mine = dict(self.trainable_named())
        if set(saved) != set(mine) or any(saved[n].shape != p.shape for n, p in mine.items()):
            raise CheckpointError(f"{path}: not this phase's adapter (its tensors differ from adapter: in params)")
        with torch.no_grad():
            for name, param in mine.items():
                param.copy_(saved[name])

    def state(self) -> dict:
        """Everything besides the live weights and the per-rank RNG needed to continue bit-exactly."""
        return {
            "optimizer": self.optimizer.state_dict(),
            "lr_scheduler": self.lr_scheduler.state_dict(),
            "ema": self.ema.state_dict(),
            "global_batch": self.split.global_batch,
        }

    def restore(self, ckpt: Path, state: dict) -> None:
        """Load live weights, ``state`` and this rank's RNG (``state["rng"]``) from a checkpoint.

        Any failure is a CheckpointError naming the file (``unet/``, ``state.pt`` or ``rng-rank<k>.pt``), so
        :func:`sdforge.training.resume.restore_newest` can fall back to an older checkpoint; the UNet is read
        from safetensors only (a pickled ``.bin`` is refused, never unpickled).
        """
        self._load_live_weights(ckpt)
        global_batch = state.get("global_batch")
        if not isinstance(global_batch, int) or global_batch < 1:
            raise CheckpointError(f"{ckpt / STATE}: no global batch recorded (written by an older sdforge)")
        if global_batch != self.split.global_batch:
            self.set_global_batch(global_batch)  # another world size: keep the run's global batch
        try:
            self.optimizer.load_state_dict(state["optimizer"])
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
            self.ema.load_state_dict(state["ema"])
            self.ema.to(getattr(self, "ema_device", self.dist.device))
            progress = Progress(**state["progress"])
        except Exception as err:
            raise CheckpointError(
                f"{ckpt / STATE}: not this run's state ({type(err).__name__}: {_first_line(err)})"
            ) from err
        same_world = state.get("world", self.dist.world) == self.dist.world
        try:
            if same_world:
                restore_rng(state["rng"], self.generator, self.dist.device)
            else:
                self.generator.set_state(state["rng"]["generator"])
        except Exception as err:
            rng = rng_path(ckpt, self.dist.rank if same_world else 0)
            raise CheckpointError(f"{rng}: not an RNG state ({type(err).__name__}: {_first_line(err)})") from err
        if not same_world:
            derive_rank_rng(self.cfg.seed, progress.step, self.dist.rank)
            log.warning(
                "resuming a checkpoint of %d rank(s) on %d: global batch %d kept (%d × %d accumulation per rank); "
                "each sample is trained exactly once, per-rank RNG re-derived from (seed, step, rank)",
                state["world"], self.dist.world, self.split.global_batch, self.split.micro, self.split.accum,
            )
        self.progress = progress
        self.loss_history = list(state.get("recent_losses", []))
        self.ledger_segments = list(state.get("ledger", []))
        log.info(
            "resumed from %s at step %d (epoch %d, step %d of it)",
            ckpt,
            self.progress.step,
            self.progress.epoch,
            self.progress.batch,
        )

    # -- the loop --------------------------------------------------------------------------
    def micro_step(
        self, latents: torch.Tensor, input_ids: torch.Tensor, seeds: torch.Tensor, scale: float, sync: bool
    ) -> torch.Tensor:
        """Forward + backward one micro-batch (sample ``i``'s randomness from ``seeds[i]``); gradients
        all-reduced only when ``sync``. Returns each sample's loss (CPU, detached)."""
        dev = self.dist.device
        with torch.no_grad():
            cond = self.text_encoder(input_ids.to(dev))[0].float()  # bf16 encoder on CUDA; no-op in fp32
        gens = part_generators(seeds)
        cond = cfg_dropout(cond, self.uncond, self.phase.cfg_dropout, gens)
        no_sync = self.model.no_sync() if (self.dist.world > 1 and not sync) else contextlib.nullcontext()
        bf16 = uses_bf16_autocast(dev, self.cfg.mixed_precision)
        autocast = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16)
        with no_sync:  # one context (DDP's no_sync() is single-use) around forward and backward
            with autocast:
                per_sample = phase_loss(
                    self.phase, self.objective, self.model, self.scheduler, latents.to(dev), cond, gens
                )
                loss = per_sample.mean()
            if not torch.isfinite(loss):
                raise FloatingPointError(
                    f"train@{self.phase_name}: non-finite loss {loss.item()} at step {self.progress.step}; "
                    "stopping (the last good checkpoint is kept). Lower the LR or check the latents."
                )
            (loss * scale).backward()
        return per_sample.detach().float().cpu()

    def optimizer_step(self) -> float:
        """Clip, step, schedule, EMA (every ``ema_update_every`` steps); return the gradient norm."""
        grad_norm = torch.nn.utils.clip_grad_norm_(self.trainable, self.cfg.grad_clip)
        self.optimizer.step()
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.progress.step += 1
        if self.progress.step % self.cfg.ema_update_every == 0:
            self.ema.step(self.trainable)
        return float(grad_norm)


def phase_loss(phase: Phase, objective: str, model, scheduler, latents: torch.Tensor, cond: torch.Tensor, gens):
    """One micro-batch's per-sample losses under the phase's objective and options (timestep sampling, noise
    offset, input perturbation, flow shift, Min-SNR-γ): :func:`model.diffusion.denoising_loss` or
    :func:`model.flow_matching.flow_matching_loss`."""
    logit_normal = tuple(phase.logit_normal) if phase.timestep_sampling == "logit_normal" else None
    if objective == "flow_matching":
        return flow_matching_loss(
            model,
            latents,
            cond,
            gens,
            num_train_timesteps=scheduler.config.num_train_timesteps,
            logit_normal=logit_normal,
            shift=phase.flow_shift,
            noise_offset=phase.noise_offset,
            input_perturbation=phase.input_perturbation,
            reduce=False,
        )
    return denoising_loss(
        model,
        scheduler,
        latents,
        cond,
        gens,
        phase.min_snr_gamma,
        phase.noise_offset,
        logit_normal,
        phase.input_perturbation,
        reduce=False,
    )


def _checkpoint_unet_weights(unet_dir: Path) -> dict[str, torch.Tensor]:
    """The live UNet state dict of a training checkpoint, from safetensors only; a CheckpointError naming the dir."""
    if not any(unet_dir.glob("*.safetensors")):
        found = sorted(p.name for p in unet_dir.iterdir()) if unet_dir.is_dir() else []
        raise CheckpointError(
            f"{unet_dir}: no .safetensors weights (found {found or 'nothing'}); other formats are never loaded"
        )
    try:
        return UNet2DConditionModel.from_pretrained(unet_dir, use_safetensors=True).state_dict()
    except Exception as err:
        raise CheckpointError(f"{unet_dir}: cannot load the UNet ({_first_line(err)})") from err


def _first_line(err: BaseException) -> str:
    """The first line of an error's message (library messages can run to many lines)."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _allow_tf32(device: torch.device, enabled: bool) -> None:
    """Set TF32 matmuls and convolutions on CUDA to ``train.tf32``; nothing elsewhere."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = enabled
        torch.backends.cudnn.allow_tf32 = enabled


def use_deterministic_kernels() -> None:
    """Deterministic kernels where torch has them (``train.deterministic``); ops without one only warn."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read when cuBLAS makes its first handle
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
    log.info(
        "train.deterministic: deterministic algorithms on (CUBLAS_WORKSPACE_CONFIG=%s)",
        os.environ["CUBLAS_WORKSPACE_CONFIG"],
    )


def _frozen_text_encoder(models: Path, device: torch.device, dtype_name: str):
    """The CLIP text encoder on ``device`` in eval mode without gradients; bf16 only on CUDA when asked."""
    dtype = torch.bfloat16 if device.type == "cuda" and dtype_name == "bf16" else torch.float32
    text_encoder = CLIPTextModel.from_pretrained(models / "text_encoder")
    text_encoder.to(device, dtype=dtype).eval()
    text_encoder.requires_grad_(False)
    return text_encoder


def _uncond_embedding(models: Path, tokenizer, text_encoder, device: torch.device) -> torch.Tensor:
    """The empty prompt's embedding: the one prepare_models wrote, else encoded now."""
    uncond_file = models / "uncond_embedding.safetensors"  # written once by prepare_models
    if uncond_file.is_file():
        return load_file(uncond_file)["uncond"].to(device)

    return encode_prompts(tokenizer, text_encoder, [""], device).float()


def _load_phase_unet(params: Params, phase: Phase, device: torch.device):
    """The phase's starting UNet (``init_from``, then ``init_path``, then its adapter if any) on ``device``,
    set up for training."""
    cfg = params.train
    init_dir = Path(params.paths.checkpoints) / phase.init_from
    weights = "live" if phase.init_from == SCRATCH else phase.init_weights
    unet = load_init_unet(init_dir, weights, params.models.unet.model_dump())
    if phase.init_path:
        load_foreign_weights(unet, Path(phase.init_path))
    if phase.adapter is not None:
        _add_unet_adapter(unet, phase.adapter)
    unet.to(device).train()
    if cfg.gradient_checkpointing:
        unet.enable_gradient_checkpointing()
    if cfg.channels_last:
        unet.to(memory_format=torch.channels_last)
    return unet


def _add_unet_adapter(unet: torch.nn.Module, spec: Adapter) -> None:
    """Freeze ``unet`` and add the phase's LoRA/DoRA (:mod:`model.adapters`); log trainable vs total weights."""
    config = lora_config(spec.type, spec.rank, spec.alpha, spec.dropout, target_pattern(spec.targets, UNET_GROUPS))
    add_adapter(unet, config)
    n_train, n_base = count_parameters(unet)
    log.info(
        "%s adapter rank %d on %s: %d trainable weights, %.2f %% of the UNet's %d",
        spec.type, spec.rank, ", ".join(spec.targets), n_train, 100 * n_train / n_base, n_base,
    )


def _wrap_ddp(unet: torch.nn.Module, dist: Dist) -> torch.nn.Module:
    """``unet`` itself on one process, else wrapped in DistributedDataParallel."""
    if dist.world > 1:
        return torch.nn.parallel.DistributedDataParallel(
            unet,
            device_ids=[dist.local_rank] if dist.device.type == "cuda" else None,
            gradient_as_bucket_view=True,
            find_unused_parameters=False,
        )
    return unet


def _build_ema(unet, trainable: list[torch.nn.Parameter], cfg: Train, device: torch.device):
    """The EMA of the trained weights and the device it lives on (``train.ema_device``: model or cpu)."""
    ema = TrainingEMA(
        trainable,
        decay=cfg.ema_decay,
        every=cfg.ema_update_every,
        model_cls=UNet2DConditionModel,
        model_config=unet.config,
    )
    ema_device = device if cfg.ema_device == "model" else torch.device("cpu")
    ema.to(ema_device)
    return ema, ema_device


LOSS_TAIL = 20
"""Step losses kept in each checkpoint (mean over ranks) so a resumed run reports the same ``final_loss``."""


def train_loop(tr: Trainer, run_dir: Path, on_step=None, notice: PreemptionNotice | None = None, watchdog=None):
    """Run the remaining epochs; checkpoint every ``save_steps`` and at each epoch end; return step losses
    (after a resume: the checkpoint's last :data:`LOSS_TAIL` losses, then this run's).

    Each optimizer step trains one global batch of the epoch's plan: ``split.accum`` micro-batches of this
    rank's part, every sample's randomness from the step's seeds (:func:`step_seeds`). After the step one
    all-reduce (:func:`sdforge.training.preemption.agree`) sums the per-source losses and settles whether
    a SIGTERM stops the run here; if so a checkpoint is written when it fits in ``train.preempt_grace_s``
    and :class:`Preempted` is raised. ``watchdog`` (:class:`sdforge.training.watchdog.Watchdog`) is told of
    every step and of every long operation.

    ``on_step(step, stats)`` is called after each optimizer step with ``loss``, ``lr``, ``grad_norm``,
    ``step_time_s`` (first batch wait to optimizer step done; checkpoint writes excluded),
    ``data_wait_s`` (of that, the time spent waiting for the loader), ``samples`` (this rank's) and
    ``sources`` (per source name: ``[loss sum, samples]`` over every rank).
    """
    phase, cfg, p, split, rank = tr.phase, tr.cfg, tr.progress, tr.split, tr.dist.rank
    losses: list[float] = list(tr.loss_history)
    saver = _Checkpointer(tr, run_dir, mark=len(losses), watchdog=watchdog)
    n_sources = len(tr.data.sources)
    while p.epoch < phase.epochs:
        t_ready = time.perf_counter()
        micro_batches, captions = tr.epoch_batches(p.epoch), tr.caption_choice(p.epoch)
        steps_in_epoch = len(micro_batches) // split.accum
        for b, latents, ids in iter_batches(tr.data, micro_batches, p.batch * split.accum, captions):
            k = b % split.accum
            if k == 0:
                group_t0, data_wait, step_losses, step_positions = t_ready, 0.0, [], []
                seeds = step_seeds(tr.generator, split.global_batch)
                if watchdog:
                    watchdog.in_step(True)  # its collectives (DDP's gradient all-reduce, agree) wait for every rank
            data_wait += time.perf_counter() - t_ready
            last = k == split.accum - 1
            sample_losses = tr.micro_step(latents, ids, seeds[split.part(k, rank)], 1.0 / split.accum, sync=last)
            tr.ledger.record(p.step + 1, p.epoch, k, micro_batches[b], sample_losses.numpy(), captions)
            step_losses.append(sample_losses)
            step_positions.append(micro_batches[b])
            if not last:
                t_ready = time.perf_counter()
                continue
            grad_norm = tr.optimizer_step()
            p.batch = b // split.accum + 1
            per_sample = torch.cat(step_losses)
            losses.append(float(per_sample.mean()))
            codes = torch.from_numpy(tr.data.source_code[np.concatenate(step_positions)])
            agreed = agree(tr.dist, per_sample, codes, n_sources, notice, saver.write_estimate(), cfg.preempt_grace_s)
            timing = {"step_time_s": time.perf_counter() - group_t0, "data_wait_s": data_wait}
            _report_step(tr, losses[-1], grad_norm, int(per_sample.numel()), timing, agreed, on_step, watchdog)
            if agreed.stop:
                path = saver.save(losses) if agreed.save else None
                saver.close()
                raise Preempted(p.step, path, agreed.elapsed_s)
            if cfg.save_steps and p.step % cfg.save_steps == 0 and p.batch < steps_in_epoch:
                saver.save(losses)
            _fault_points(p.step, rank)
            t_ready = time.perf_counter()
        p.epoch, p.batch = p.epoch + 1, 0
        saver.save(losses)
    saver.close()
    return losses


def _report_step(tr: Trainer, loss: float, grad_norm: float, samples: int, timing: dict, agreed, on_step, watchdog):
    """After an optimizer step: the watchdog's beat (a validation step gets the long allowance on every rank:
    the main rank samples images, the others wait in the next step) and ``on_step``'s stats."""
    step, cfg = tr.progress.step, tr.cfg
    if watchdog:
        watchdog.beat(step)
        if cfg.validation_every and step % cfg.validation_every == 0:
            watchdog.long_operation()
    if not on_step:
        return
    sources = {
        name: [agreed.source_loss_sum[i], agreed.source_count[i]]
        for i, name in enumerate(tr.data.sources)
        if agreed.source_count[i]
    }
    stats = {"loss": loss, "lr": tr.lr_scheduler.get_last_lr()[0], "grad_norm": grad_norm, **timing,
             "samples": samples, "sources": sources}
    on_step(step, stats)
    if watchdog:
        watchdog.step_resumes()


def _fault_points(step: int, rank: int) -> None:
    _kill_point(step)
    _hang_point(step, rank)


def _kill_point(step: int) -> None:
    """Fault injection for resume tests: ``SDFORGE_KILL_AT_STEP=N`` SIGKILLs this process after step N;
    ``SDFORGE_TERM_AT_STEP=N`` sends it SIGTERM (a preemption notice) after step N."""
    if os.environ.get("SDFORGE_KILL_AT_STEP") == str(step):
        log.warning("SDFORGE_KILL_AT_STEP=%d: killing this process (fault injection)", step)
        os.kill(os.getpid(), signal.SIGKILL)
    if os.environ.get("SDFORGE_TERM_AT_STEP") == str(step):
        log.warning("SDFORGE_TERM_AT_STEP=%d: SIGTERM to this process (fault injection)", step)
        os.kill(os.getpid(), signal.SIGTERM)


def _hang_point(step: int, rank: int) -> None:
    """Fault injection for the hang watchdog: ``SDFORGE_HANG_AT_STEP=N`` (with ``SDFORGE_HANG_RANK=r``: on
    rank r only) stops this rank after step N for ever, as a stuck data read or a dead peer would."""
    if os.environ.get("SDFORGE_HANG_AT_STEP") != str(step):
        return
    if os.environ.get("SDFORGE_HANG_RANK", str(rank)) != str(rank):
        return
    log.warning("SDFORGE_HANG_AT_STEP=%d: rank %d hangs here (fault injection)", step, rank)
    while True:
        time.sleep(1)


FIRST_WRITE_BYTES_PER_S = 100e6
"""Before a run has written a checkpoint, a write is estimated at this rate over its state's bytes (a slow
disk with the sha256 manifest: bench/README.md, checkpoint_write); afterwards from the measured writes."""


class _Checkpointer:
    """The checkpoints of one :func:`train_loop`.

    Each save gathers every rank's RNG state and ledger records to rank 0, which writes the ledger segment,
    then the checkpoint (with the mean loss since the previous one, over all ranks, for ``keep_best``),
    prunes, and — with ``train.checkpoint_s3`` — queues their upload; :meth:`close` waits for pending
    uploads. Every save is timed: :meth:`write_estimate` is what the preemption grace is judged by.
    """

    def __init__(self, tr: Trainer, run_dir: Path, mark: int = 0, watchdog=None):
        self.tr, self.run_dir, self.mark, self.watchdog = tr, run_dir, mark, watchdog
        cfg = tr.cfg
        self.retention = Retention(cfg.keep_last, cfg.keep_every, cfg.keep_best)
        self.uploader = None
        self.last_save_s: float | None = None
        if cfg.checkpoint_s3 and tr.dist.is_main:
            remote = RemoteRun(run_url(cfg.checkpoint_s3, run_dir))
            self.uploader = BackgroundUploader(remote, run_dir, self.retention)

    def write_estimate(self) -> float:
        """Seconds a checkpoint write is expected to take: the slowest measured one (+25 %), else by size."""
        if self.last_save_s is not None:
            return 1.25 * self.last_save_s
        weights = sum(p.numel() * p.element_size() for p in self.tr.trainable)
        return 4 * weights / FIRST_WRITE_BYTES_PER_S  # live + EMA + AdamW's two moments

    def save(self, losses: list[float]) -> Path | None:
        """Write a checkpoint at the current step (every rank takes part); its path on rank 0."""
        t0 = time.perf_counter()
        if self.watchdog:
            self.watchdog.long_operation()
        path = self._save(losses)
        elapsed = time.perf_counter() - t0
        self.last_save_s = max(elapsed, self.last_save_s or 0.0)
        if self.watchdog:
            self.watchdog.step_resumes()
        return path

    def _save(self, losses: list[float]) -> Path | None:
        tr, dist = self.tr, self.tr.dist
        recent, self.mark = losses[self.mark :], len(losses)
        loss = sum(recent) / len(recent) if recent else None
        rng = [capture_rng(tr.generator, dist.device)]
        records = [tr.ledger.take()]
        tail = losses[-LOSS_TAIL:]
        if dist.world > 1:
            total = torch.tensor([sum(recent), len(recent)], dtype=torch.float64, device=dist.device)
            torch.distributed.all_reduce(total)
            loss = float(total[0] / total[1]) if total[1] else None
            tail_t = torch.tensor(tail, dtype=torch.float64, device=dist.device)  # same length on every rank
            torch.distributed.all_reduce(tail_t)
            tail = (tail_t / dist.world).tolist()
            gathered = [None] * dist.world if dist.is_main else None
            torch.distributed.gather_object((rng[0], records[0]), gathered, dst=0)
            if dist.is_main:
                rng, records = [g[0] for g in gathered], [g[1] for g in gathered]
        path = None
        if dist.is_main:
            self._write_ledger(records)
            config = tr.params.model_dump(mode="json")
            state = {**tr.state(), "recent_losses": tail}
            path = save_checkpoint(
                self.run_dir, tr.progress, tr.write_live_weights, state, self.retention, rng=rng, loss=loss,
                config=config, ledger=tr.ledger_segments,
            )
            if self.uploader:
                self.uploader.submit(path, [self.run_dir / LEDGER_DIR / e["name"] for e in tr.ledger_segments])
        if dist.world > 1:
            torch.distributed.barrier()
        return path

    def _write_ledger(self, records: list[dict]) -> None:
        """Rank 0: the records since the previous checkpoint as a segment, appended to the run's list."""
        tr = self.tr
        first = tr.ledger_segments[-1]["name"] if tr.ledger_segments else None
        start = int(first.split("-")[1].split(".")[0]) + 1 if first else 1
        if start > tr.progress.step:  # nothing trained since (e.g. an epoch end right after a save)
            return
        entry = write_segment(self.run_dir, records, tr.data, start, tr.progress.step)
        tr.ledger_segments = [*tr.ledger_segments, entry]

    def close(self) -> None:
        if self.uploader:
            self.uploader.close()
            self.uploader = None


def start_ledger(tr: Trainer, run_dir: Path) -> None:
    """Main rank, after the restore: keep only the ledger segments of the checkpoint resumed from (none on a
    fresh start): the records of steps lost with a killed process go."""
    if tr.dist.is_main:
        keep_only(run_dir, tr.ledger_segments)
