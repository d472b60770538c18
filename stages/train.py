"""Stage ``train@<phase>``: train the UNet on the phase's latent mix, from the previous phase's weights.

Runs as one process (CPU demo, one GPU) or under ``torchrun`` (DDP: NCCL on CUDA, gloo on CPU).
Resumable: checkpoints go to ``${paths.runs}/<phase>/`` (not a DVC output, so they survive a
killed ``dvc repro``); a rerun with the same inputs continues from the newest good checkpoint
mid-epoch. Output ``${paths.checkpoints}/<phase>/``: ``unet/`` (live), ``unet_ema/`` (EMA),
``state.json``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from stages.checkpoints import Progress, load_state, newest_loadable, save_checkpoint
from stages.common import InputError, stage_cli, write_json
from stages.config import SCRATCH, Params, Phase, Train
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


@dataclass(frozen=True)
class Dist:
    """This process's place in the (possibly single-process) job."""

    rank: int
    world: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed() -> Dist:
    """Read torchrun's env; start the process group (NCCL on CUDA, gloo on CPU) when world > 1."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world > 1 and not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return Dist(rank, world, local_rank, device)


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


def fingerprint(*files_or_dirs: Path, extra: dict) -> str:
    """Hash of the phase's inputs: a run dir from other inputs is stale and must not be resumed."""
    h = hashlib.sha256(json.dumps(extra, sort_keys=True, default=str).encode())
    for root in files_or_dirs:
        for f in sorted([root] if root.is_file() else root.rglob("*")):
            if f.is_file():
                h.update(f.relative_to(root.parent).as_posix().encode())
                h.update(f.read_bytes())
    return h.hexdigest()[:16]


def _prepare_run_dir(run_dir: Path, fp: str, is_main: bool) -> None:
    stamp = run_dir / "fingerprint.txt"
    if is_main:
        if run_dir.exists() and (not stamp.is_file() or stamp.read_text().strip() != fp):
            log.warning("%s holds a run from other inputs; starting this phase afresh", run_dir)
            shutil.rmtree(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        stamp.write_text(fp + "\n")
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


class Trainer:
    """The phase's model, optimizer, schedule, EMA and data, with checkpoint save/restore."""

    def __init__(self, params: Params, phase_name: str, dist: Dist):
        from diffusers import DDPMScheduler, UNet2DConditionModel
        from diffusers.training_utils import EMAModel
        from transformers import CLIPTextModel, CLIPTokenizer

        from model.diffusion import build_lr_scheduler, optimizer_steps
        from model.sampler import encode_prompts

        self.params, self.phase_name, self.dist = params, phase_name, dist
        self.phase: Phase = params.phases[phase_name]
        self.cfg: Train = params.train
        paths, models = params.paths, Path(params.paths.models)
        self.data = LatentIndexDataset(Path(paths.mixes) / f"{phase_name}.parquet", Path(paths.latents))
        self.scheduler = DDPMScheduler.from_pretrained(models / "scheduler")
        self.tokenizer = CLIPTokenizer.from_pretrained(models / "tokenizer")
        self.text_encoder = CLIPTextModel.from_pretrained(models / "text_encoder").to(dist.device).eval()
        self.text_encoder.requires_grad_(False)
        self.uncond = encode_prompts(self.tokenizer, self.text_encoder, [""], dist.device)
        init_dir = Path(paths.checkpoints) / self.phase.init_from
        weights = "live" if self.phase.init_from == SCRATCH else self.phase.init_weights
        self.unet = load_init_unet(init_dir, weights, params.models.unet.model_dump()).to(dist.device).train()
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
        self.ema = EMAModel(
            self.unet.parameters(),
            decay=self.cfg.ema_decay,
            model_cls=UNet2DConditionModel,
            model_config=self.unet.config,
        )
        self.ema.to(dist.device)
        self.generator = torch.Generator().manual_seed(self.cfg.seed * 1000 + dist.rank)
        self.progress = Progress()

    # -- checkpoint state ------------------------------------------------------------------
    def state(self) -> dict:
        """Everything besides the live weights needed to continue bit-exactly."""
        state = {
            "optimizer": self.optimizer.state_dict(),
            "lr_scheduler": self.lr_scheduler.state_dict(),
            "ema": self.ema.state_dict(),
            "generator": self.generator.get_state(),
            "torch_rng": torch.get_rng_state(),
        }
        if torch.cuda.is_available():
            state["cuda_rng"] = torch.cuda.get_rng_state(self.dist.device)
        return state

    def restore(self, ckpt: Path, state: dict) -> None:
        """Load live weights and ``state`` from a checkpoint."""
        from diffusers import UNet2DConditionModel

        loaded = UNet2DConditionModel.from_pretrained(ckpt / "unet")
        self.unet.load_state_dict(loaded.state_dict())
        self.optimizer.load_state_dict(state["optimizer"])
        self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        self.ema.load_state_dict(state["ema"])
        self.ema.to(self.dist.device)
        self.generator.set_state(state["generator"])
        torch.set_rng_state(state["torch_rng"])
        if "cuda_rng" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda_rng"], self.dist.device)
        self.progress = Progress(**state["progress"])
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
            cond = self.text_encoder(input_ids.to(dev))[0]
        cond = cfg_dropout(cond, self.uncond, self.phase.cfg_dropout, self.generator)
        no_sync = self.model.no_sync() if (self.dist.world > 1 and not sync) else contextlib.nullcontext()
        autocast = torch.autocast(
            "cuda", dtype=torch.bfloat16, enabled=dev.type == "cuda" and self.cfg.mixed_precision == "bf16"
        )
        with no_sync, autocast:
            loss = denoising_loss(
                self.model, self.scheduler, latents.to(dev), cond, self.generator, self.phase.min_snr_gamma
            )
        if not torch.isfinite(loss):
            raise FloatingPointError(
                f"train@{self.phase_name}: non-finite loss {loss.item()} at step {self.progress.step}; "
                "stopping (the last good checkpoint is kept). Lower the LR or check the latents."
            )
        with no_sync:
            (loss * scale).backward()
        return float(loss.detach())

    def optimizer_step(self) -> float:
        """Clip, step, schedule, EMA; return the gradient norm."""
        grad_norm = torch.nn.utils.clip_grad_norm_(self.unet.parameters(), self.cfg.grad_clip)
        self.optimizer.step()
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.ema.step(self.unet.parameters())
        self.progress.step += 1
        return float(grad_norm)


def _adamw(parameters, lr: float, cfg: Train, device: torch.device) -> torch.optim.AdamW:
    kwargs = dict(lr=lr, betas=cfg.adam_betas, eps=cfg.adam_eps, weight_decay=cfg.weight_decay)
    if device.type == "cuda":
        try:
            return torch.optim.AdamW(parameters, fused=True, **kwargs)
        except (RuntimeError, TypeError) as err:
            log.warning("fused AdamW unavailable (%s); using the default implementation", err)
    return torch.optim.AdamW(parameters, **kwargs)


def train_loop(tr: Trainer, run_dir: Path, on_step=None) -> list[float]:
    """Run the remaining epochs; checkpoint every ``save_steps`` and at each epoch end; return step losses."""
    phase, cfg, p = tr.phase, tr.cfg, tr.progress
    losses: list[float] = []
    accum = phase.grad_accum
    while p.epoch < phase.epochs:
        group_loss, in_group = 0.0, 0
        for b, latents, ids in iter_batches(
            tr.data, p.epoch, cfg.seed, tr.dist.rank, tr.dist.world, phase.batch_size, start_batch=p.batch
        ):
            group_start = (b // accum) * accum
            group_size = min(accum, tr.batches_per_epoch - group_start)
            last_in_group = b == group_start + group_size - 1
            t0 = time.perf_counter()
            group_loss += tr.micro_step(latents, ids, 1.0 / group_size, sync=last_in_group)
            in_group += 1
            if not last_in_group:
                continue
            grad_norm = tr.optimizer_step()
            loss = group_loss / in_group
            losses.append(loss)
            group_loss, in_group = 0.0, 0
            p.batch = b + 1
            if on_step:
                on_step(p.step, loss, tr.lr_scheduler.get_last_lr()[0], grad_norm, time.perf_counter() - t0)
            if cfg.save_steps and p.step % cfg.save_steps == 0 and p.batch < tr.batches_per_epoch:
                _checkpoint(tr, run_dir)
        p.epoch, p.batch = p.epoch + 1, 0
        _checkpoint(tr, run_dir)
    return losses


def _checkpoint(tr: Trainer, run_dir: Path) -> None:
    if tr.dist.is_main:
        save_checkpoint(run_dir, tr.progress, tr.unet, tr.state(), tr.cfg.keep_last)
    if tr.dist.world > 1:
        torch.distributed.barrier()


def export_phase(tr: Trainer, out_dir: Path, losses: list[float]) -> None:
    """Write ``unet/`` (live), ``unet_ema/`` and ``state.json`` — the phase's DVC output."""
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    tr.unet.save_pretrained(out_dir / "unet", safe_serialization=True)
    tr.ema.store(tr.unet.parameters())
    tr.ema.copy_to(tr.unet.parameters())
    tr.unet.save_pretrained(out_dir / "unet_ema", safe_serialization=True)
    tr.ema.restore(tr.unet.parameters())
    write_json(
        out_dir / "state.json",
        {
            "phase": tr.phase_name,
            "step": tr.progress.step,
            "epochs": tr.progress.epoch,
            "final_loss": losses[-1] if losses else None,
        },
    )


def run(params: Params, phase_name: str) -> dict:
    """Train one phase (resuming if possible); export its weights; return metrics."""
    torch.manual_seed(params.train.seed)
    dist = init_distributed()
    tr = Trainer(params, phase_name, dist)
    paths = params.paths
    run_dir = Path(paths.runs) / phase_name
    fp = fingerprint(
        Path(paths.mixes) / f"{phase_name}.parquet",
        Path(paths.checkpoints) / tr.phase.init_from,
        extra={"phase": tr.phase.model_dump(), "train": params.train.model_dump(), "world": dist.world},
    )
    _prepare_run_dir(run_dir, fp, dist.is_main)
    found = newest_loadable(run_dir, load_state)
    if found:
        tr.restore(*found)
    resumed_at = tr.progress.step
    start = time.perf_counter()
    logger = _StepLogger(params, phase_name, tr) if dist.is_main else None
    try:
        losses = train_loop(tr, run_dir, on_step=logger.log if logger else None)
    finally:
        if logger:
            logger.close()
    elapsed = time.perf_counter() - start
    trained = tr.progress.step - resumed_at
    metrics = {
        "steps": tr.progress.step,
        "total_steps": tr.total_steps,
        "resumed_at_step": resumed_at,
        "samples": len(tr.data),
        "epochs": tr.progress.epoch,
        "final_loss": _tail_mean(losses),
        "seconds": round(elapsed, 2),
        "samples_per_s": round(
            trained * tr.phase.batch_size * tr.phase.grad_accum * dist.world / max(elapsed, 1e-9), 2
        ),
    }
    if dist.is_main:
        export_phase(tr, Path(paths.checkpoints) / phase_name, losses)
        logger.finish(metrics, Path(paths.checkpoints) / phase_name)
    if dist.world > 1:
        torch.distributed.destroy_process_group()
    return metrics


def _tail_mean(values: list[float], n: int = 20) -> float | None:
    tail = values[-n:]
    return round(sum(tail) / len(tail), 6) if tail else None


class _StepLogger:
    """MLflow step metrics (main rank only), a progress bar, and the phase's final report."""

    def __init__(self, params: Params, phase_name: str, tr: Trainer):
        from tqdm import tqdm

        from stages.tracking import stage_run

        self.every = params.train.log_every
        self.losses: list[float] = []
        self._ctx = stage_run(
            params.tracking,
            phase_name,
            "train",
            {
                "phase": params.phases[phase_name].model_dump(),
                "train": params.train.model_dump(),
                "unet": params.models.unet.model_dump(),
            },
        )
        self.mlflow = self._ctx.__enter__()
        self.bar = tqdm(
            total=tr.total_steps,
            initial=tr.progress.step,
            desc=f"train@{phase_name}",
            disable=os.environ.get("SDFORGE_PROGRESS", "1") == "0",
        )
        self.batch = tr.phase.batch_size * tr.phase.grad_accum * tr.dist.world

    def log(self, step: int, loss: float, lr: float, grad_norm: float, seconds: float) -> None:
        self.losses.append(loss)
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{loss:.4f}")
        if step % self.every == 0:
            self.mlflow.log_metrics(
                {
                    "loss": loss,
                    "lr": lr,
                    "grad_norm": grad_norm,
                    "step_time_s": seconds,
                    "samples_per_s": self.batch / max(seconds, 1e-9),
                },
                step=step,
            )

    def finish(self, metrics: dict, out_dir: Path) -> None:
        self.mlflow.log_metrics({k: v for k, v in metrics.items() if isinstance(v, int | float)})
        self.mlflow.set_tag("checkpoint", str(out_dir.resolve()))

    def close(self) -> None:
        self.bar.close()
        self._ctx.__exit__(None, None, None)


def main(argv: list[str] | None = None) -> None:
    """CLI: ``python -m stages.train --params params.yaml --item <phase>``."""
    stage_cli("train", run, argv=argv)


if __name__ == "__main__":
    main()
