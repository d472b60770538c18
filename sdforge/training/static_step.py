"""``train.cuda_graphs: step``: the optimizer step over static buffers, captured as CUDA graphs on CUDA.

A CUDA graph replays recorded kernels on fixed addresses, so everything a replay reads or writes must outlive it:
- **inputs**: one set of device buffers per micro-batch shape (bucket × batch size × whether DDP would sync); each
  micro-batch and its random draws (:class:`~sdforge.training.step.MicroBatch`, drawn on the host as in the eager
  step) are copied into its shape's buffers;
- **gradients**: kept between steps and zeroed in place (``zero_grad(set_to_none=False)``), so the micro-batch
  graphs accumulate into the tensors the optimizer graph reads;
- **outputs**: each sample's loss and the gradient norm, read once per step after the optimizer step, as today;
- **the LR**: a device tensor the schedule fills in place (:meth:`Optimization.lr_on_device`); AdamW is capturable;
- **autocast** keeps no cache of bf16 weight copies (``cache_enabled=False``, torch's rule for a captured region).

Each :class:`GraphedCall` runs eagerly for its first :data:`WARMUP` calls (on a side stream on CUDA, as torch's
recipe asks), is captured on the next and replayed from then on; every graph of a job shares one memory pool (they
never run concurrently, and each keeps its outputs alive). The LR schedule, the EMA and the post-hoc EMA run outside
the graphs (host-side decays). On a CPU there is no capture: the same buffers and calls run eagerly every time, so
the static path's numerics are tested here (bit-identical to the eager step, tests/sdforge/training/
test_static_step.py), and a stand-in capture tests the warm-up/capture/replay order.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial

import torch

from sdforge.config import Phase
from sdforge.io import InputError
from sdforge.training.distributed import part_generators
from sdforge.training.step import MicroBatch, draw_micro, micro_loss

log = logging.getLogger(__name__)

WARMUP = 3
"""Eager calls before a graph is captured (torch's whole-network recipe warms up 3 iterations on a side stream)."""


class CudaGraphs:
    """Capture on CUDA: eager warm-up calls on a side stream, graphs captured into one shared memory pool."""

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device)
        self.pool = torch.cuda.graph_pool_handle()

    def eager(self, fn: Callable[[], None]) -> None:
        """``fn()`` on the side stream, ordered after and before the current stream's work."""
        current = torch.cuda.current_stream()
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            fn()
        current.wait_stream(self.stream)

    def capture(self, fn: Callable[[], None]) -> Callable[[], None]:
        """Record ``fn()``'s kernels (nothing runs); the graph's replay. Thread-local capture: CUDA work of the job's
        other threads (a background checkpoint's copies) goes on and does not invalidate it."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            fn()
        return graph.replay


class GraphedCall:
    """``fn()`` — device work on tensors that outlive it — eager for its first :data:`WARMUP` calls, then captured
    once by ``graphs`` and replayed on every later call; always eager without ``graphs`` (a CPU)."""

    def __init__(self, fn: Callable[[], None], graphs, check: Callable[[], None] | None = None, name: str = "step"):
        self.fn, self.graphs, self.check, self.name = fn, graphs, check, name
        self.calls = 0
        self.replay: Callable[[], None] | None = None
        self.capture_error: str | None = None
        """Why the capture failed (this call then stays eager, with a warning); None while it has not."""

    def __call__(self) -> None:
        self.calls += 1
        if self.graphs is None:
            self.fn()
        elif self.calls <= WARMUP:
            self.graphs.eager(self.fn)
        else:
            if self.replay is None:
                self._capture()
            (self.replay or self.fn)()
        if self.check is not None and self.replay is None:
            self.check()

    def _capture(self) -> None:
        """Capture ``fn``; if CUDA refuses (an operation that cannot be captured), say which and stay eager: a
        capture runs nothing, so the eager call that follows does the call's work once."""
        try:
            self.replay = self.graphs.capture(self.fn)
        except Exception as err:  # noqa: BLE001 - any capture failure: the step still trains, eagerly
            self.capture_error = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err) else ''}"
            self.graphs = None
            log.warning("train.cuda_graphs: the %s could not be captured (%s); it runs eagerly from here on",
                        self.name, self.capture_error)  # fmt: skip


class StaticStep:
    """The micro-batch and optimizer calls of one job over static buffers (``train.cuda_graphs: step``)."""

    def __init__(self, job, graphs: CudaGraphs | None):
        self.graphs = graphs
        self.buffers: dict[tuple, MicroBatch] = {}
        """Per micro-batch key (shapes, sync): the device :class:`MicroBatch` its call reads."""
        self.losses: dict[tuple, torch.Tensor] = {}
        self.calls: dict[tuple, GraphedCall] = {}
        self.grad_norm = torch.zeros((), dtype=torch.float32, device=job.dist.device)
        self.trainable = job.optim.trainable
        self.gradients: list[int] | None = None
        """The gradient tensors' addresses once they exist: an eager call must accumulate into the same ones."""
        body = partial(self._optimizer_body, job)
        self.optimizer_call = GraphedCall(body, graphs, self._check_gradients, "optimizer")
        self.lr_ready = False

    def micro_step(self, job, latents, input_ids, seeds, scale: float, sync: bool, control=None,
                   sizes=None) -> torch.Tensor:  # fmt: skip
        """:func:`~sdforge.training.step.micro_step` through this shape's buffers and call; each sample's loss
        (a copy: the buffer is the next replay's)."""
        host = draw_micro(job, latents, input_ids, part_generators(seeds), control, sizes)
        key = (*(tuple(t.shape) for t in host.tensors()), sync)
        if key not in self.buffers:
            self._add_shape(job, key, host, scale, sync)
        else:
            for dst, src in zip(self.buffers[key].tensors(), host.tensors(), strict=True):
                dst.copy_(_pinned(src), non_blocking=True)
        self.calls[key]()
        return self.losses[key].clone()

    def _add_shape(self, job, key: tuple, host: MicroBatch, scale: float, sync: bool) -> None:
        """Allocate ``key``'s buffers from its first micro-batch, and its call."""
        self.buffers[key] = batch = host.to(job.dist.device)
        self.losses[key] = torch.zeros(host.latents.shape[0], dtype=torch.float32, device=job.dist.device)

        def body() -> None:
            self.losses[key].copy_(micro_loss(job, batch, scale, sync, cast_cache=False))

        self.calls[key] = GraphedCall(body, self.graphs, self._check_gradients, f"micro-batch {key[0]}")
        log.info("train.cuda_graphs: micro-batch shape %s (%d shape(s)); %s", key[0], len(self.buffers),
                 "captured after its warm-up" if self.graphs is not None else "static buffers, no capture (CPU)")

    def optimizer_step(self, job, step: int) -> torch.Tensor:
        """Optimizer step number ``step``: the captured clip + AdamW step + in-place zeroing, then the schedule and
        EMAs outside the graph; the gradient norm (a device tensor, this call's buffer)."""
        job.optim.settle()
        if job.optim.capturable and not self.lr_ready:  # after any restore: a checkpoint brings float LRs
            job.optim.lr_on_device()
            self.lr_ready = True
        self.optimizer_call()
        job.optim.advance(step)
        return self.grad_norm

    def _optimizer_body(self, job) -> None:
        job.model.reduce_outside_gradients()
        self.grad_norm.copy_(job.optim.apply_gradients(set_to_none=False))
        if self.gradients is None:
            self.gradients = [p.grad.data_ptr() for p in self.trainable if p.grad is not None]

    def _check_gradients(self) -> None:
        """After an eager call: the gradients are the tensors a captured graph reads (a RuntimeError if autograd
        replaced one instead of accumulating into it)."""
        if self.gradients is None:
            return
        now = [p.grad.data_ptr() for p in self.trainable if p.grad is not None]
        if now != self.gradients:
            raise RuntimeError("train.cuda_graphs: a gradient tensor was replaced, not accumulated into; the "
                               "captured steps would read stale gradients. Set train.cuda_graphs: off")  # fmt: skip

    def release(self, job) -> None:
        """Free the gradients, buffers and graphs (before the phase's export; the step is not used again)."""
        job.optim.optimizer.zero_grad(set_to_none=True)
        for table in (self.buffers, self.losses, self.calls):
            table.clear()
        self.optimizer_call.replay = None  # the graph and its pool go with it
        self.gradients = None


def _pinned(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU tensor in pinned memory when CUDA is there (an asynchronous copy up), else as it is."""
    return tensor.pin_memory() if tensor.device.type == "cpu" and torch.cuda.is_available() else tensor


def graph_blockers(phase: Phase, phase_name: str, world: int, sharded: bool) -> list[str]:
    """Why ``train.cuda_graphs: step`` cannot run this phase (empty: it can), each naming its key."""
    out = []
    if world > 1:
        out.append(f"{world} ranks (DDP's bucket hooks and FSDP's collectives are not captured: one rank per job)")
    if sharded:
        out.append("train.parallel fsdp")
    if phase.optimizer != "adamw":
        out.append(f"phases.{phase_name}.optimizer {phase.optimizer} (only AdamW is capturable)")
    if phase.distill is not None:
        out.append(f"phases.{phase_name}.distill (the teacher's draws are made inside its step)")
    return out


def static_step(job) -> StaticStep | None:
    """``job``'s :class:`StaticStep` for ``train.cuda_graphs: step`` (captured on CUDA only), or None for ``off``; an
    InputError naming what the phase uses that a captured step cannot."""
    if job.cfg.cuda_graphs != "step":
        return None
    blockers = graph_blockers(job.phase, job.phase_name, job.dist.world, job.model.sharded)
    if blockers:
        raise InputError(f"train@{job.phase_name}: train.cuda_graphs step cannot run with " + "; ".join(blockers)
                         + ". Set train.cuda_graphs: off, or change those keys")  # fmt: skip
    device = job.dist.device
    return StaticStep(job, CudaGraphs(device) if device.type == "cuda" else None)
