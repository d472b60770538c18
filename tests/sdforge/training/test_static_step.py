"""``train.cuda_graphs: step`` on a CPU: the static-buffer step against the eager one over 20 optimizer steps of a
tiny UNet (two micro-batch shapes, accumulation 2, every random option of a phase on), bit for bit; the warm-up,
capture and replay order with a stand-in for CUDA's capture; the LR held in a device tensor; the refusals."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from model.builders import build_unet, noise_scheduler, unet_config
from model.denoisers import CondPart
from sdforge.config import NoiseSchedule, Phase, Train
from sdforge.training.distributed import Dist, step_seeds
from sdforge.training.optimization import Optimization
from sdforge.training.state import TrainState
from sdforge.training.static_step import WARMUP, GraphedCall, StaticStep, graph_blockers
from sdforge.training.step import micro_step, optimizer_step
from sdforge.training.trained_model import FullUNet
from tests.fixtures.training import TRAIN_UNET

STEPS, ACCUM = 20, 2
CPU = Dist(0, 1, 0, torch.device("cpu"))
OPTIONS = dict(noise_offset=0.05, input_perturbation=0.1, min_snr_gamma=5.0, timestep_sampling="logit_normal")
"""Every draw a phase can make: offset, logit-normal level, ξ; and Min-SNR weights."""
SHAPES = ((4, 8, 8), (3, 8, 16))
"""Two buckets' micro-batches (batch, h, w): odd steps train on the first, even steps on the second."""


class FakeGraphs:
    """CUDA's capture as the CPU can play it: a capture records the function without running it (as CUDA's does);
    a replay runs it; eager calls run it. Counts each."""

    def __init__(self):
        self.eager_calls = self.captures = self.replays = 0

    def eager(self, fn) -> None:
        self.eager_calls += 1
        fn()

    def capture(self, fn):
        self.captures += 1

        def replay() -> None:
            self.replays += 1
            fn()

        return replay


def _job(objective: str = "diffusion") -> SimpleNamespace:
    """A tiny UNet's job with two caption parts (the whole prompt and its first 8 tokens) and CFG dropout."""
    cfg = Train(ema_decay=0.9, mixed_precision="no")
    phase = Phase(mix={"a": 1.0}, samples=8, lr=1e-3, warmup_steps=2, cfg_dropout=0.2, **OPTIONS)
    unet = build_unet(unet_config(TRAIN_UNET), seed=0).train()
    model = FullUNet(unet, CPU)
    optim = Optimization(model.trainable, phase, cfg, CPU.device, "test", unet)
    optim.plan(STEPS)
    dim = TRAIN_UNET["cross_attention_dim"]
    table = torch.randn(100, dim, generator=torch.Generator().manual_seed(1))
    conditioning = SimpleNamespace(encode=lambda ids: table[ids], uncond=torch.zeros(1, 77, dim),
                                   scheduler=noise_scheduler(NoiseSchedule().model_dump()))  # fmt: skip
    whole, head = CondPart("prompt", slice(0, 77), slice(0, dim)), CondPart("head", slice(0, 8), slice(0, dim))
    parts = [(whole, 0.1), (head, 0.3)]
    return SimpleNamespace(dist=CPU, conditioning=conditioning, phase=phase, cfg=cfg, model=model, optim=optim,
                           objective=objective, caption_parts=parts, attention=None, static=None,
                           phase_name="test")  # fmt: skip


def _train(job, micro, step_fn) -> dict:
    """20 optimizer steps of ``job``: per step ``ACCUM`` micro-batches of that step's shape through ``micro``, then
    ``step_fn``; the per-sample losses, gradient norms, LRs and the final weights and EMA."""
    state, gen = TrainState(0, 0), torch.Generator().manual_seed(2)
    out = {"losses": [], "grad_norms": [], "lrs": []}
    for step in range(1, STEPS + 1):
        batch, h, w = SHAPES[(step - 1) % 2]
        seeds = step_seeds(state.generator, batch * ACCUM)
        for k in range(ACCUM):
            latents = torch.randn(batch, 4, h, w, generator=gen)
            ids = torch.randint(0, 100, (batch, 77), generator=gen)
            part = seeds[k * batch : (k + 1) * batch]
            out["losses"].append(micro(job, latents, ids, part, 1.0 / ACCUM, sync=k == ACCUM - 1))
        out["grad_norms"].append(step_fn(job, step).clone())
        out["lrs"].append(job.optim.lr())
    out["weights"] = {k: v.clone() for k, v in job.model.unet.state_dict().items()}
    out["ema"] = [p.clone() for p in job.optim.ema.shadow_params]
    return out


def _train_static(graphs) -> tuple[StaticStep, dict]:
    """:func:`_train` through a :class:`StaticStep` capturing with ``graphs``; the step and the results."""
    job = _job()
    static = StaticStep(job, graphs)
    job.static = static
    return static, _train(job, static.micro_step, optimizer_step)


def _assert_identical(a: dict, b: dict) -> None:
    assert a["lrs"] == b["lrs"]
    for key in ("losses", "grad_norms", "ema"):
        assert len(a[key]) == len(b[key])
        for x, y in zip(a[key], b[key], strict=True):
            assert torch.equal(x, y), key
    moved = max(float((a["weights"][k] - b["weights"][k]).abs().max()) for k in a["weights"])
    assert moved == 0.0 and set(a["weights"]) == set(b["weights"])


@pytest.mark.parametrize("objective", ["diffusion", "flow_matching"])
def test_static_step_is_bit_identical_to_the_eager_step(objective):
    """The static buffers, in-place gradient zeroing and the split optimizer step change no bit over 20 steps."""
    eager = _train(_job(objective), micro_step, optimizer_step)
    job = _job(objective)
    static = StaticStep(job, None)
    job.static = static
    out = _train(job, static.micro_step, optimizer_step)
    _assert_identical(out, eager)
    assert len(static.buffers) == 2 * ACCUM  # per shape: the micro-batch that syncs and the one that does not
    start = _job(objective).model.unet.state_dict()
    assert max(float((out["weights"][k] - start[k]).abs().max()) for k in start) > 1e-3  # it trained


def test_warm_up_then_one_capture_then_replays_reproduce_the_eager_step():
    """With a capture that records without running (as CUDA's): each micro-batch shape and the optimizer run eagerly
    for their first 3 calls, are captured on the 4th and replayed from then on; the training is still bit-identical
    (a captured call that also ran, or a replay that did not, would shift every later step)."""
    eager = _train(_job(), micro_step, optimizer_step)
    graphs = FakeGraphs()
    static, out = _train_static(graphs)
    _assert_identical(out, eager)
    shape_calls = STEPS // 2  # each (shape, sync) key: once per step of its shape
    keys = len(static.calls) + 1  # the micro-batch keys and the optimizer
    assert graphs.captures == keys == 2 * ACCUM + 1
    assert graphs.eager_calls == WARMUP * keys
    assert graphs.replays == 2 * ACCUM * (shape_calls - WARMUP) + (STEPS - WARMUP)


def test_a_graphed_call_checks_its_gradients_only_while_eager():
    ran, checks = [], []
    call = GraphedCall(lambda: ran.append(1), FakeGraphs(), lambda: checks.append(1))
    for _ in range(WARMUP + 3):
        call()
    assert len(ran) == WARMUP + 3 and len(checks) == WARMUP


def test_a_replaced_gradient_is_refused():
    """A captured graph reads the gradient tensors it saw; if autograd ever replaced one instead of accumulating into
    it, the eager call that did so stops the run."""
    job = _job()
    static = StaticStep(job, None)
    job.static = static
    latents, ids = torch.randn(4, 4, 8, 8), torch.zeros(4, 77, dtype=torch.long)
    static.micro_step(job, latents, ids, torch.arange(4), 1.0, sync=True)
    static.optimizer_step(job, 1)  # the gradients' addresses are taken here
    first = job.model.trainable[0]
    first.grad = first.grad.clone()  # a new tensor where the graph reads the old one
    with pytest.raises(RuntimeError, match="gradient tensor was replaced"):
        static.micro_step(job, latents, ids, torch.arange(4), 1.0, sync=True)


def test_the_lr_in_a_device_tensor_follows_the_schedule_and_saves_as_floats():
    """A captured optimizer reads its LR from a tensor the schedule fills in place; checkpoints keep floats, so runs
    with and without CUDA graphs resume from each other's."""
    floats, tensors = _job().optim, _job().optim
    tensors.lr_on_device()
    held = tensors.optimizer.param_groups[0]["lr"]
    for _ in range(5):
        for optim in (floats, tensors):
            optim.lr_scheduler.step()
        assert tensors.optimizer.param_groups[0]["lr"] is held  # filled in place: the graph's address
        assert tensors.lr() == pytest.approx(floats.lr(), rel=1e-6) and isinstance(tensors.lr(), float)
    state = tensors.state_dict()
    assert isinstance(state["optimizer"]["param_groups"][0]["lr"], float)
    inner = state["lr_scheduler"].get("_schedulers", [state["lr_scheduler"]])
    assert all(isinstance(lr, float) for s in [state["lr_scheduler"], *inner] for lr in s["_last_lr"])
    assert isinstance(held, torch.Tensor)  # the live LR is untouched by saving


def test_what_a_captured_step_cannot_run_is_refused_by_name():
    phase = Phase(mix={"a": 1.0}, samples=8, lr=1.0, optimizer="prodigy")
    found = graph_blockers(phase, "phase3", world=2, sharded=True)
    assert [b.split(" (")[0] for b in found] == ["2 ranks", "train.parallel fsdp", "phases.phase3.optimizer prodigy"]
    assert graph_blockers(Phase(mix={"a": 1.0}, samples=8, lr=1e-4), "phase1", world=1, sharded=False) == []


class RefusingGraphs(FakeGraphs):
    """A capture CUDA refuses (an operation that cannot be captured)."""

    def capture(self, fn):
        self.captures += 1
        raise RuntimeError("operation not permitted when stream is capturing")


def test_a_refused_capture_leaves_that_call_eager_and_the_training_unchanged(caplog):
    """Every capture fails: each call warns once, naming itself and CUDA's reason, then runs eagerly; the training is
    still bit-identical to the eager step (a failed capture ran nothing, and the call's work is done once)."""
    eager = _train(_job(), micro_step, optimizer_step)
    graphs = RefusingGraphs()
    static, out = _train_static(graphs)
    _assert_identical(out, eager)
    calls = [*static.calls.values(), static.optimizer_call]
    assert graphs.captures == len(calls) == 2 * ACCUM + 1 and graphs.replays == 0
    assert all(c.capture_error == "RuntimeError: operation not permitted when stream is capturing" for c in calls)
    warned = [r.getMessage() for r in caplog.records if "could not be captured" in r.getMessage()]
    assert len(warned) == len(calls) and any("the optimizer could not" in w for w in warned)
