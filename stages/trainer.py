"""The training job of one phase: model, optimizer, LR schedule, EMA, data, and the step loop.

Everything needed to continue bit-exactly is in :meth:`Trainer.state` (saved with the live
weights in each checkpoint); the data order is a pure function of (seed, epoch, rank).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from pathlib import Path

import torch

from stages.checkpoints import Progress, Retention, capture_rng, restore_rng, save_checkpoint
from stages.common import InputError
from stages.config import SCRATCH, Params, Phase, Train
from stages.distributed import Dist, sample_generators
from stages.latent_loader import LatentIndexDataset, batches_per_epoch, iter_batches

log = logging.getLogger(__name__)

ARCH_KEYS = (
    "block_out_channels",
    "layers_per_block",
    "cross_attention_dim",
    "attention_head_dim",
    "down_block_types",
    "up_block_types",
    "in_channels",
    "out_channels",
    "norm_num_groups",
)


def load_init_unet(init_dir: Path, weights: str, spec: dict):
    """The phase's starting UNet; architecture keys must equal ``models.unet``'s, else a clear error."""
    from diffusers import UNet2DConditionModel

    sub = "unet_ema" if weights == "ema" else "unet"
    path = init_dir / sub
    if not (path / "config.json").is_file():
        raise InputError(f"{path}: no UNet checkpoint to start from (run the previous phase or prepare_models)")
    unet = UNet2DConditionModel.from_pretrained(path)
    for key in ARCH_KEYS:
        want, got = spec.get(key), unet.config.get(key)
        if _norm(want) != _norm(got):
            raise InputError(f"{path}: checkpoint has {key}={got!r} but params models.unet.{key}={want!r}")
    return unet


def _norm(v):
    return list(v) if isinstance(v, list | tuple) else v


class Trainer:
    """The phase's model, optimizer, schedule, EMA and data, with checkpoint save/restore."""

    def __init__(self, params: Params, phase_name: str, dist: Dist):
        from diffusers import DDPMScheduler, UNet2DConditionModel
        from transformers import CLIPTextModel, CLIPTokenizer

        from model.diffusion import TrainingEMA, build_lr_scheduler, optimizer_steps
        from model.sampler import encode_prompts

        self.params, self.phase_name, self.dist = params, phase_name, dist
        self.phase: Phase = params.phases[phase_name]
        self.cfg: Train = params.train
        paths, models = params.paths, Path(params.paths.models)
        cuda = dist.device.type == "cuda"
        if cuda:
            torch.backends.cuda.matmul.allow_tf32 = self.cfg.tf32
            torch.backends.cudnn.allow_tf32 = self.cfg.tf32
        self.data = LatentIndexDataset(Path(paths.mixes) / f"{phase_name}.parquet", Path(paths.latents))
        self.scheduler = DDPMScheduler.from_pretrained(models / "scheduler")
        self.tokenizer = CLIPTokenizer.from_pretrained(models / "tokenizer")
        te_dtype = torch.bfloat16 if cuda and self.cfg.text_encoder_dtype == "bf16" else torch.float32
        self.text_encoder = CLIPTextModel.from_pretrained(models / "text_encoder")
        self.text_encoder.to(dist.device, dtype=te_dtype).eval()
        self.text_encoder.requires_grad_(False)
        uncond_file = models / "uncond_embedding.safetensors"  # written once by prepare_models
        if uncond_file.is_file():
            from safetensors.torch import load_file

            self.uncond = load_file(uncond_file)["uncond"].to(dist.device)
        else:
            self.uncond = encode_prompts(self.tokenizer, self.text_encoder, [""], dist.device).float()
        init_dir = Path(paths.checkpoints) / self.phase.init_from
        weights = "live" if self.phase.init_from == SCRATCH else self.phase.init_weights
        self.unet = load_init_unet(init_dir, weights, params.models.unet.model_dump())
        if self.phase.init_path:
            load_foreign_weights(self.unet, Path(self.phase.init_path))
        self.unet.to(dist.device).train()
        if self.cfg.gradient_checkpointing:
            self.unet.enable_gradient_checkpointing()
        if self.cfg.channels_last:
            self.unet.to(memory_format=torch.channels_last)
        self.model = self.unet
        if dist.world > 1:
            self.model = torch.nn.parallel.DistributedDataParallel(
                self.unet,
                device_ids=[dist.local_rank] if dist.device.type == "cuda" else None,
                gradient_as_bucket_view=True,
                find_unused_parameters=False,
            )
        self.optimizer = _adamw(self.unet.parameters(), self.phase.lr, self.cfg, dist.device)
        self.batches_per_epoch = batches_per_epoch(len(self.data), dist.world, self.phase.batch_size)
        self.total_steps = optimizer_steps(
            len(self.data) // dist.world, self.phase.batch_size, self.phase.grad_accum, self.phase.epochs
        )
        self.lr_scheduler = build_lr_scheduler(self.optimizer, self.phase.warmup_steps, self.total_steps)
        self.ema = TrainingEMA(
            self.unet.parameters(),
            decay=self.cfg.ema_decay,
            every=self.cfg.ema_update_every,
            model_cls=UNet2DConditionModel,
            model_config=self.unet.config,
        )
        self.ema_device = dist.device if self.cfg.ema_device == "model" else torch.device("cpu")
        self.ema.to(self.ema_device)
        # Same state on every rank: per-sample streams are split off it (stages.distributed.sample_generators).
        self.generator = torch.Generator().manual_seed(self.cfg.seed * 1000)
        self.progress = Progress()
        self.loss_history: list[float] = []  # a resumed run's last losses before the checkpoint

    # -- checkpoint state ------------------------------------------------------------------
    def state(self) -> dict:
        """Everything besides the live weights and the per-rank RNG needed to continue bit-exactly."""
        return {
            "optimizer": self.optimizer.state_dict(),
            "lr_scheduler": self.lr_scheduler.state_dict(),
            "ema": self.ema.state_dict(),
        }

    def restore(self, ckpt: Path, state: dict) -> None:
        """Load live weights, ``state`` and this rank's RNG (``state["rng"]``) from a checkpoint."""
        from diffusers import UNet2DConditionModel

        loaded = UNet2DConditionModel.from_pretrained(ckpt / "unet")
        self.unet.load_state_dict(loaded.state_dict())
        self.optimizer.load_state_dict(state["optimizer"])
        self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        self.ema.load_state_dict(state["ema"])
        self.ema.to(getattr(self, "ema_device", self.dist.device))
        restore_rng(state["rng"], self.generator, self.dist.device)
        self.progress = Progress(**state["progress"])
        self.loss_history = list(state.get("recent_losses", []))
        log.info(
            "resumed from %s at step %d (epoch %d, batch %d)",
            ckpt,
            self.progress.step,
            self.progress.epoch,
            self.progress.batch,
        )

    # -- the loop --------------------------------------------------------------------------
    def micro_step(self, latents: torch.Tensor, input_ids: torch.Tensor, scale: float, sync: bool) -> float:
        """Forward + backward one micro-batch; gradients all-reduced only when ``sync``."""
        from model.diffusion import cfg_dropout, denoising_loss

        dev = self.dist.device
        with torch.no_grad():
            cond = self.text_encoder(input_ids.to(dev))[0].float()  # bf16 encoder on CUDA; no-op in fp32
        gens = sample_generators(self.generator, latents.shape[0], self.dist.rank, self.dist.world)
        cond = cfg_dropout(cond, self.uncond, self.phase.cfg_dropout, gens)
        no_sync = self.model.no_sync() if (self.dist.world > 1 and not sync) else contextlib.nullcontext()
        autocast = torch.autocast(
            "cuda", dtype=torch.bfloat16, enabled=dev.type == "cuda" and self.cfg.mixed_precision == "bf16"
        )
        with no_sync:  # one context (DDP's no_sync() is single-use) around forward and backward
            with autocast:
                loss = denoising_loss(
                    self.model,
                    self.scheduler,
                    latents.to(dev),
                    cond,
                    gens,
                    self.phase.min_snr_gamma,
                    self.cfg.noise_offset,
                )
            if not torch.isfinite(loss):
                raise FloatingPointError(
                    f"train@{self.phase_name}: non-finite loss {loss.item()} at step {self.progress.step}; "
                    "stopping (the last good checkpoint is kept). Lower the LR or check the latents."
                )
            (loss * scale).backward()
        return float(loss.detach())

    def optimizer_step(self) -> float:
        """Clip, step, schedule, EMA (every ``ema_update_every`` steps); return the gradient norm."""
        grad_norm = torch.nn.utils.clip_grad_norm_(self.unet.parameters(), self.cfg.grad_clip)
        self.optimizer.step()
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.progress.step += 1
        if self.progress.step % self.cfg.ema_update_every == 0:
            self.ema.step(self.unet.parameters())
        return float(grad_norm)


def load_foreign_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """A state dict from ``.safetensors`` or ``.pt``/``.pth``/``.bin`` (``weights_only``), unnested and unprefixed."""
    from model.weights import strip_wrapper_prefixes, unnest_state_dict

    if not path.is_file():
        raise InputError(f"phase init_path {path}: no such file")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            obj = load_file(path)
        elif path.suffix in (".pt", ".pth", ".bin", ".ckpt"):
            obj = torch.load(path, map_location="cpu", weights_only=True)
        else:
            raise InputError(f"phase init_path {path}: expected .safetensors, .pt, .pth, .bin or .ckpt")
        return strip_wrapper_prefixes(unnest_state_dict(obj))
    except InputError:
        raise
    except Exception as err:  # unpicklable, truncated, not a dict: all the file's fault
        raise InputError(f"phase init_path {path}: cannot read a state dict ({err})") from err


def load_foreign_weights(unet: torch.nn.Module, path: Path) -> None:
    """Load the foreign state dict at ``path`` strictly into ``unet``; a mismatch is an InputError naming keys."""
    from model.weights import load_state_dict_strict

    state_dict = load_foreign_state_dict(path)
    try:
        load_state_dict_strict(unet, state_dict)
    except ValueError as err:
        raise InputError(f"phase init_path {path}: {err} (params models.unet must describe this checkpoint)") from err
    log.info("initialised the UNet from %s (%d tensors)", path, len(state_dict))


def _adamw(parameters, lr: float, cfg: Train, device: torch.device) -> torch.optim.AdamW:
    kwargs = dict(lr=lr, betas=cfg.adam_betas, eps=cfg.adam_eps, weight_decay=cfg.weight_decay)
    if device.type == "cuda":
        try:
            return torch.optim.AdamW(parameters, fused=True, **kwargs)
        except (RuntimeError, TypeError) as err:
            log.warning("fused AdamW unavailable (%s); using the default implementation", err)
    return torch.optim.AdamW(parameters, **kwargs)


LOSS_TAIL = 20
"""Step losses kept in each checkpoint (mean over ranks) so a resumed run reports the same ``final_loss``."""


def train_loop(tr: Trainer, run_dir: Path, on_step=None) -> list[float]:
    """Run the remaining epochs; checkpoint every ``save_steps`` and at each epoch end; return step losses
    (after a resume: the checkpoint's last :data:`LOSS_TAIL` losses, then this run's).

    ``on_step(step, stats)`` is called after each optimizer step with ``loss``, ``lr``, ``grad_norm``,
    ``step_time_s`` (first batch wait to optimizer step done; checkpoint writes excluded),
    ``data_wait_s`` (of that, the time spent waiting for the loader) and ``samples`` (this rank's).
    """
    phase, cfg, p = tr.phase, tr.cfg, tr.progress
    losses: list[float] = list(tr.loss_history)
    saver = _Checkpointer(tr, run_dir, mark=len(losses))
    accum = phase.grad_accum
    while p.epoch < phase.epochs:
        group_loss, in_group = 0.0, 0
        t_ready = group_t0 = time.perf_counter()
        data_wait, group_samples = 0.0, 0
        for b, latents, ids in iter_batches(
            tr.data, p.epoch, cfg.seed, tr.dist.rank, tr.dist.world, phase.batch_size, start_batch=p.batch
        ):
            if in_group == 0:
                group_t0, data_wait, group_samples = t_ready, 0.0, 0
            data_wait += time.perf_counter() - t_ready
            group_samples += latents.shape[0]
            group_start = (b // accum) * accum
            group_size = min(accum, tr.batches_per_epoch - group_start)
            last_in_group = b == group_start + group_size - 1
            group_loss += tr.micro_step(latents, ids, 1.0 / group_size, sync=last_in_group)
            in_group += 1
            if not last_in_group:
                t_ready = time.perf_counter()
                continue
            grad_norm = tr.optimizer_step()
            loss = group_loss / in_group
            losses.append(loss)
            group_loss, in_group = 0.0, 0
            p.batch = b + 1
            if on_step:
                stats = {
                    "loss": loss,
                    "lr": tr.lr_scheduler.get_last_lr()[0],
                    "grad_norm": grad_norm,
                    "step_time_s": time.perf_counter() - group_t0,
                    "data_wait_s": data_wait,
                    "samples": group_samples,
                }
                on_step(p.step, stats)
            if cfg.save_steps and p.step % cfg.save_steps == 0 and p.batch < tr.batches_per_epoch:
                saver.save(losses)
            _kill_point(p.step)
            t_ready = time.perf_counter()
        p.epoch, p.batch = p.epoch + 1, 0
        saver.save(losses)
    saver.close()
    return losses


def _kill_point(step: int) -> None:
    """Fault injection for resume tests: ``SDFORGE_KILL_AT_STEP=N`` SIGKILLs this process after step N."""
    if os.environ.get("SDFORGE_KILL_AT_STEP") == str(step):
        log.warning("SDFORGE_KILL_AT_STEP=%d: killing this process (fault injection)", step)
        os.kill(os.getpid(), signal.SIGKILL)


class _Checkpointer:
    """The checkpoints of one :func:`train_loop`.

    Each save gathers every rank's RNG state to rank 0, which writes the checkpoint (with the mean
    loss since the previous one, over all ranks, for ``keep_best``), prunes, and — with
    ``train.checkpoint_s3`` — queues its upload; :meth:`close` waits for pending uploads.
    """

    def __init__(self, tr: Trainer, run_dir: Path, mark: int = 0):
        self.tr, self.run_dir, self.mark = tr, run_dir, mark
        cfg = tr.cfg
        self.retention = Retention(cfg.keep_last, cfg.keep_every, cfg.keep_best)
        self.uploader = None
        if cfg.checkpoint_s3 and tr.dist.is_main:
            from stages.s3_checkpoints import BackgroundUploader, RemoteRun, run_url

            remote = RemoteRun(run_url(cfg.checkpoint_s3, run_dir))
            self.uploader = BackgroundUploader(remote, run_dir, self.retention)

    def save(self, losses: list[float]) -> None:
        tr, dist = self.tr, self.tr.dist
        recent, self.mark = losses[self.mark :], len(losses)
        loss = sum(recent) / len(recent) if recent else None
        rng = [capture_rng(tr.generator, dist.device)]
        tail = losses[-LOSS_TAIL:]
        if dist.world > 1:
            total = torch.tensor([sum(recent), len(recent)], dtype=torch.float64, device=dist.device)
            torch.distributed.all_reduce(total)
            loss = float(total[0] / total[1]) if total[1] else None
            tail_t = torch.tensor(tail, dtype=torch.float64, device=dist.device)  # same length on every rank
            torch.distributed.all_reduce(tail_t)
            tail = (tail_t / dist.world).tolist()
            gathered = [None] * dist.world if dist.is_main else None
            torch.distributed.gather_object(rng[0], gathered, dst=0)
            rng = gathered
        if dist.is_main:
            config = tr.params.model_dump(mode="json")
            state = {**tr.state(), "recent_losses": tail}
            path = save_checkpoint(
                self.run_dir, tr.progress, tr.unet, state, self.retention, rng=rng, loss=loss, config=config
            )
            if self.uploader:
                self.uploader.submit(path)
        if dist.world > 1:
            torch.distributed.barrier()

    def close(self) -> None:
        if self.uploader:
            self.uploader.close()
