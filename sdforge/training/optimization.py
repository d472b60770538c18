"""How the trained weights move: the optimizer (``phases.<p>.optimizer``), the LR schedule built from the phase's
explicit peak LR, gradient clipping and the EMA — one stateful component of a checkpoint."""

from __future__ import annotations

from collections.abc import Callable

import torch

from model.diffusion import TrainingEMA, build_lr_scheduler
from model.posthoc_ema import PowerEMAs
from model.sharding import whole
from sdforge.config import Phase, Train
from sdforge.training.optimizers import build_optimizer


class Optimization:
    """Optimizer, LR schedule and EMA of ``trainable``; :meth:`plan` (re)builds the schedule for a step count."""

    def __init__(self, trainable: list, phase: Phase, cfg: Train, device: torch.device, where: str, model):
        self.trainable, self.cfg = trainable, cfg
        self.peak_lr, self.warmup_steps = phase.lr, phase.warmup_steps
        self.device = device
        self.capturable = cfg.cuda_graphs == "step" and device.type == "cuda"
        """The optimizer step is captured in a CUDA graph (``train.cuda_graphs: step`` on CUDA): AdamW is built
        capturable, and its LR becomes a device tensor before the first step (:meth:`lr_on_device`)."""
        self.optimizer = build_optimizer(phase.optimizer, trainable, phase.lr, cfg, device, where, self.capturable)
        self.lr_scheduler = None
        self.ema_device = device if cfg.ema_device == "model" else torch.device("cpu")
        self.ema = TrainingEMA(
            trainable,
            decay=cfg.ema_decay,
            every=cfg.ema_update_every,
            foreach=self.ema_device.type == "cuda",  # one kernel per update on CUDA; CPU keeps its exact sums
            model_cls=None if model is None else type(model),  # what diffusers' EMAModel would save it as
            model_config=getattr(model, "config", None),
        )
        self.ema.to(self.ema_device)
        rels = cfg.posthoc_sigma_rels if phase.posthoc_ema else []
        self.posthoc = PowerEMAs(trainable, rels, self.ema_device) if rels else None
        """The post-hoc EMA's tracked profiles (``train.posthoc_sigma_rels``, unless the phase sets
        ``posthoc_ema: false``), updated every step."""
        self.snapshot_read: Callable[[], None] | None = None
        """Set while a background checkpoint still copies the weights, optimizer and EMA state (a CPU run,
        :mod:`sdforge.training.async_checkpoint`): :meth:`settle` waits for it before anything changes them."""

    def settle(self) -> None:
        """Wait until a background checkpoint has copied the state this component changes (none: returns)."""
        if self.snapshot_read is not None:
            wait, self.snapshot_read = self.snapshot_read, None
            wait()

    def plan(self, total_steps: int) -> None:
        """Warm-up + cosine over ``total_steps`` optimizer steps from the phase's peak LR (none without steps:
        a checkpoint may still bring the run's own global batch; the job refuses to train without steps)."""
        self.lr_scheduler = (
            build_lr_scheduler(self.optimizer, self.peak_lr, self.warmup_steps, total_steps) if total_steps else None
        )

    def step(self, step: int) -> torch.Tensor:
        """Optimizer step number ``step`` (1-based): clip, step, zero the gradients, schedule, EMA (every
        ``train.ema_update_every`` steps); return the gradient norm (a device tensor: no host read here)."""
        self.settle()
        grad_norm = self.apply_gradients(set_to_none=True)
        self.advance(step)
        return grad_norm

    def apply_gradients(self, set_to_none: bool) -> torch.Tensor:
        """Clip, step and zero the gradients (to None, or in place: the static step keeps its gradient buffers);
        the gradient norm before clipping (device). Device work only, with a capturable optimizer."""
        grad_norm = whole(torch.nn.utils.clip_grad_norm_(self.trainable, self.cfg.grad_clip))  # sharded: all ranks'
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=set_to_none)
        return grad_norm

    def advance(self, step: int) -> None:
        """After optimizer step ``step``: the LR schedule moves on, the EMA (every ``train.ema_update_every`` steps)
        and the post-hoc EMA's profiles update."""
        self.lr_scheduler.step()
        if step % self.cfg.ema_update_every == 0:
            self.ema.step(self.trainable)
        if self.posthoc is not None:
            self.posthoc.update(self.trainable, step)

    def lr_on_device(self) -> None:
        """Hold each param group's LR in a device tensor, which the LR schedule then fills in place: a captured
        optimizer step reads the step's LR from it (a float LR would be frozen into the graph at capture)."""
        for group in self.optimizer.param_groups:
            if not isinstance(group["lr"], torch.Tensor):
                group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float32, device=self.device)

    def lr(self) -> float:
        """The LR of the next optimizer step."""
        return float(self.lr_scheduler.get_last_lr()[0])

    def state_dict(self) -> dict:
        """The optimizer, LR schedule, EMA and post-hoc EMA state; LRs as floats (a run with and without
        ``train.cuda_graphs`` resumes from the other's checkpoints)."""
        state = {
            "optimizer": _float_lrs(self.optimizer.state_dict()),
            "lr_scheduler": _float_lrs(self.lr_scheduler.state_dict()),
            "ema": self.ema.state_dict(),
        }
        if self.posthoc is not None:
            state["posthoc_ema"] = self.posthoc.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        self.ema.load_state_dict(state["ema"])
        self.ema.to(self.ema_device)
        if self.posthoc is not None:
            self.posthoc.load_state_dict(state["posthoc_ema"])

    @torch.no_grad()
    def materialize(self) -> None:
        """Create the optimizer's per-weight state (a step of zero gradients at zero LR: the weights do not move), so
        that a sharded checkpoint has tensors to be read into (:mod:`sdforge.training.sharded_state`)."""
        if self.optimizer.state:
            return
        lrs = [group["lr"] for group in self.optimizer.param_groups]
        for param in self.trainable:
            param.grad = torch.zeros_like(param)
        for group in self.optimizer.param_groups:
            group["lr"] = 0.0
        self.optimizer.step()
        for group, lr in zip(self.optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)

    def release(self) -> None:
        """Free the optimizer's moments and the gradients (before an export: no memory beyond training's)."""
        self.optimizer.state.clear()
        self.optimizer.zero_grad(set_to_none=True)


def _float_lrs(state: dict) -> dict:
    """``state`` (an optimizer's or LR scheduler's state dict) with its device-tensor LRs as floats."""
    for group in state.get("param_groups", []):
        if isinstance(group.get("lr"), torch.Tensor):
            group["lr"] = float(group["lr"])
    if "_last_lr" in state:
        state["_last_lr"] = [float(lr) for lr in state["_last_lr"]]
    if "_schedulers" in state:  # SequentialLR: warm-up and cosine hold their own
        state["_schedulers"] = [_float_lrs(dict(inner)) for inner in state["_schedulers"]]
    return state
