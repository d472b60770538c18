"""Benchmark: one optimizer step of our trainer vs a plain diffusers-style loop, same denoiser and batch.

``python -m bench.train_step [--quick] [--config demo|full] [--family unet|mmdit] [--batch N] [--ckpt off|on|both]
[--cuda-graphs off,step] [--overlay YAML] [--phase NAME] [--memory-budget-gib G]``

``--family mmdit`` (default: the config's ``models.denoiser.family``) times the MM-DiT of ``models.mmdit`` (the full
config's default: the 1.2B preset at 64² latents, 1,024 image tokens) under rectified flow; its plain loop is
diffusers' ``examples/dreambooth/train_dreambooth_sd3.py`` body (logit-normal σ, ``(1 − σ)·x + σ·ε``, target
``ε − x``). The UNet description below is the default family's.

- ours: the real :func:`sdforge.training.step.micro_step` + :meth:`sdforge.training.optimization.Optimization.step`
  (noise and timesteps from the job's CPU generator, CFG dropout, bf16 autocast on CUDA,
  channels_last as configured, Min-SNR-γ as the config's phase 1, fused AdamW on CUDA, grad clip,
  warmup+cosine LR schedule, :class:`model.diffusion.TrainingEMA` where the config puts it) on the job's
  components assembled without data or files (:class:`_BenchJob`);
- plain: diffusers ``examples/text_to_image/train_text_to_image.py``'s loop body — ``randn_like``
  noise and ``randint`` timesteps on the device, ``add_noise``, UNet forward under the same autocast,
  ``F.mse_loss``, backward, ``clip_grad_norm_``, default ``AdamW``, ``EMAModel.step`` — on a UNet
  built from the same seed (so the same weights), the same gradient-checkpointing setting, no channels_last.

Both get the same latents ``[B, 4, s, s]`` (``s`` = ``models.unet.sample_size``) and precomputed
text embeddings ``[B, 77, cross_attention_dim]`` (the frozen text encoder is left out of both).
Variants alternate (ours, plain, ours, plain…), each on a freshly built model, warm-up steps
untimed; img/s is batch ÷ the median step time over the timed steps of all its rounds. Peak memory
is ``torch.cuda.max_memory_allocated`` on CUDA, else the process's peak RSS (``VmHWM``, reset
before each variant through ``/proc/self/clear_refs``). FLOPs per training sample are counted
with ``torch.utils.flop_counter`` on the meta device (forward + backward, batch 1, no recomputation;
SD1.5 at 64×64: 2.41 TFLOP); MFU is
achieved FLOP/s ÷ ``--peak-tflops`` (989 TFLOP/s, H100 SXM bf16 dense, on CUDA; none on CPU).

**An adapter phase** (``--phase`` names one with ``adapter:``; e.g. ``--overlay configs/full/sdxl.yaml --phase
sdxl_attention``, SDXL base 1.0's UNet with the run's self-attention LoRA): ours adds the phase's LoRA/DoRA as the
trainer does (:func:`sdforge.training.model_setup.add_unet_adapter`, ``adapter.base_precision`` included) and
trains it in :class:`sdforge.training.trained_model.AdapterUNet`; plain is diffusers'
``examples/text_to_image/train_text_to_image_lora_sdxl.py`` body — the frozen UNet cast to bf16 where autocast is on
(its ``weight_dtype``), a peft LoRA of the same rank on the same layers (``init_lora_weights="gaussian"``) kept in
fp32, AdamW on the LoRA alone, no EMA — called through the family's ``predict`` (SDXL's added conditions). The
FLOPs (and MFU) stay the full model's training FLOPs: an adapter's backward skips the frozen weights' gradients, so
its MFU is overstated. ``--memory-budget-gib`` caps the CUDA allocator as ``train.memory_budget_gib`` does
(:func:`sdforge.training.memory_plan.cap_device_memory`): a smaller card, emulated.

The last line is ``RESULT name=train_step ratio=<ours img/s ÷ plain img/s> ...`` for the first
(config, checkpointing) pair run.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import statistics
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import yaml

from bench._common import load_average, machine, result_line
from model.adapters import target_pattern
from model.builders import noise_scheduler
from model.denoisers import family
from model.precision import uses_bf16_autocast
from model.sharding import shard_model
from model.speed import attention_backends, compile_unet
from sdforge.config import load_params, parse_params
from sdforge.training.distributed import Dist, step_seeds
from sdforge.training.memory_plan import cap_device_memory
from sdforge.training.model_setup import add_unet_adapter
from sdforge.training.optimization import Optimization
from sdforge.training.parallel import ensure_process_group
from sdforge.training.sharded_model import ShardedUNet
from sdforge.training.state import TrainState
from sdforge.training.static_step import WARMUP, CudaGraphs, StaticStep
from sdforge.training.step import micro_step, optimizer_step
from sdforge.training.trained_model import AdapterUNet, FullUNet

REPO = Path(__file__).resolve().parents[1]
CONFIGS = {
    "demo": REPO / "params.yaml",
    "demo-mmdit": REPO / "configs/demo-mmdit/overlay.yaml",
    "demo-sdxl": REPO / "configs/demo-sdxl/overlay.yaml",
    "full": REPO / "configs/full/params.yaml",
}
"""``demo-mmdit`` / ``demo-sdxl``: the demo with ``make demo-mmdit``'s / ``make demo-sdxl``'s overlay merged on top
(its tiny MM-DiT / SDXL UNet)."""
DEMO_OVERLAYS = ("demo-mmdit", "demo-sdxl")
H100_BF16_DENSE_TFLOPS = 989.0
SD15_TFLOP_PER_SAMPLE_64 = 2.6
"""The issue's estimate for SD1.5 at 64×64 latents (forward + backward ≈ 3 × forward)."""


def _load(config: str, overlay: Path | None = None):
    """``config``'s params (a demo overlay merged onto the demo's), with ``overlay`` merged on top if given."""
    if config not in DEMO_OVERLAYS and overlay is None:
        return load_params(CONFIGS[config])
    data = yaml.safe_load(CONFIGS["demo" if config in DEMO_OVERLAYS else config].read_text())
    for path in ([CONFIGS[config]] if config in DEMO_OVERLAYS else []) + ([overlay] if overlay else []):
        data = _merged(data, yaml.safe_load(path.read_text()))
    if config in DEMO_OVERLAYS:  # both families refuse consistency distillation, which the bench never times
        data["phases"] = {k: v for k, v in data["phases"].items() if "distill" not in v}
    return parse_params(data)


def _merged(base: dict, overlay: dict) -> dict:
    """``base`` with ``overlay`` merged in key by key (the demo tools' overlay rule)."""
    out = dict(base)
    for key, value in overlay.items():
        out[key] = _merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


_SEEDED: dict[str, torch.nn.Module] = {}
"""Each config's seed-0 UNet, built once on CPU (860M parameters take seconds to initialise), copied per variant."""


def _family_config(params):
    """The denoiser family of ``params`` and its diffusers config."""
    fam = family(params.models.denoiser.family)
    return fam, fam.config(params.models.denoiser_spec)


def with_family(params, name: str):
    """``params`` with ``models.denoiser.family: name`` (an unvalidated copy: the bench reads models and train only)."""
    models = params.models.model_copy(update={"denoiser": params.models.denoiser.model_copy(update={"family": name})})
    return params.model_copy(update={"models": models})


def with_phase(params, name: str):
    """``params`` with phase ``name`` alone (the bench's phase: its lr, Min-SNR γ, adapter); a KeyError lists the
    phases."""
    if name not in params.phases:
        raise KeyError(f"no phase {name!r}; the config's phases: {sorted(params.phases)}")
    return params.model_copy(update={"phases": {name: params.phases[name]}})


def _random_cond(params, batch: int) -> torch.Tensor:
    """A seeded stand-in for the family's packed text conditioning of ``batch`` prompts (77 tokens)."""
    fam, config = _family_config(params)
    return torch.randn(batch, *fam.cond_shape(config, 77), generator=torch.Generator().manual_seed(1))


def _build_unet(params, device: torch.device, ckpt: bool, channels_last: bool, adapt=None):
    """A copy of the config's seed-0 denoiser, ``adapt(unet)`` applied before it moves to ``device`` (as the
    trainer adds an adapter), set up for training."""
    fam, config = _family_config(params)
    key = repr(sorted(config.items()))
    if key not in _SEEDED:
        _SEEDED[key] = fam.build(config, seed=0)
    unet = copy.deepcopy(_SEEDED[key])
    if adapt is not None:
        adapt(unet)
    unet = unet.to(device).train()
    if ckpt:
        unet.enable_gradient_checkpointing()
    if channels_last:
        unet.to(memory_format=torch.channels_last)
    return unet


class _Conditioning:
    """Stands in for :class:`sdforge.training.conditioning.Conditioning`: precomputed text embeddings."""

    def __init__(self, cond: torch.Tensor, scheduler):
        self.cond, self.scheduler = cond, scheduler
        self.uncond = torch.zeros(1, *cond.shape[1:], device=cond.device)

    def encode(self, input_ids):
        return self.cond


@dataclass
class _BenchJob:
    """The parts of :class:`sdforge.training.job.TrainJob` one step reads, built without data or files."""

    params: object
    phase: object
    cfg: object
    dist: Dist
    model: FullUNet
    optim: Optimization
    conditioning: _Conditioning
    state: TrainState
    objective: str = "diffusion"
    """The family's first objective (``flow_matching`` for the MM-DiT)."""
    phase_name: str = "bench"
    attention: object = None
    caption_parts: tuple = ()
    static: object = None
    """``train.cuda_graphs: step``'s :class:`StaticStep` (None: the eager step)."""


def _ours(params, device, batch, ckpt, channels_last=None, compile_="off", attention="auto", parallel="ddp",
          graphs="off"):  # fmt: skip
    """The real step on the job's components, built without data or files (``compile_``: ``train.compile``,
    ``attention``: ``train.attention``, both through :mod:`model.speed` as the trainer applies them; ``parallel``:
    ``fsdp`` shards the model over this one process as ``train.parallel: fsdp`` does, the wrapper's own cost;
    ``graphs``: ``train.cuda_graphs``, the static step captured on CUDA)."""
    phase = next(iter(params.phases.values()))
    update = {"activation_checkpointing": "full" if ckpt else "off", "compile": compile_, "attention": attention,
              "cuda_graphs": graphs}  # fmt: skip
    if channels_last is not None:
        update["channels_last"] = channels_last
    cfg = params.train.model_copy(update=update)
    dist = Dist(rank=0, world=1, local_rank=0, device=device)
    fam = family(params.models.denoiser.family)
    adapt = None if phase.adapter is None else lambda unet: add_unet_adapter(unet, phase.adapter, fam)
    unet = _build_unet(params, device, ckpt, cfg.channels_last, adapt)
    compile_unet(unet, compile_)
    if phase.adapter is not None:
        model = AdapterUNet(unet, dist, phase.adapter)
    elif parallel == "fsdp":
        ensure_process_group(dist)
        units = shard_model(unet, family(params.models.denoiser.family).shard_blocks, device,
                            uses_bf16_autocast(device, cfg.mixed_precision))  # fmt: skip
        model = ShardedUNet(unet, dist, units)
    else:
        model = FullUNet(unet, dist)
    optim = Optimization(model.trainable, phase, cfg, device, "bench", model.unet)
    optim.plan(10**6)
    cond = _random_cond(params, batch).to(device)
    conditioning = _Conditioning(cond, noise_scheduler(params.models.noise.model_dump()))
    objective = family(params.models.denoiser.family).objectives[0]
    job = _BenchJob(params, phase, cfg, dist, model, optim, conditioning, TrainState(0, 0), objective=objective,
                    attention=attention_backends(attention, device))  # fmt: skip
    ids = torch.zeros(batch, 77, dtype=torch.long)
    if graphs == "step":
        job.static = StaticStep(job, CudaGraphs(device) if device.type == "cuda" else None)
    micro = micro_step if job.static is None else job.static.micro_step

    def step(latents):
        seeds = step_seeds(job.state.generator, latents.shape[0])
        micro(job, latents, ids, seeds, 1.0, sync=True)
        job.state.progress.step += 1
        optimizer_step(job, job.state.progress.step)

    return step


def _plain(params, device, batch, ckpt):
    """diffusers examples/text_to_image/train_text_to_image.py's loop body (the MM-DiT: :func:`_plain_flow`); on an
    adapter phase, train_text_to_image_lora_sdxl.py's (:func:`_plain_lora_unet`: the LoRA alone trained, no EMA)."""
    if family(params.models.denoiser.family).objectives == ("flow_matching",):
        return _plain_flow(params, device, batch, ckpt)
    import torch.nn.functional as F
    from diffusers.training_utils import EMAModel

    cfg, phase = params.train, next(iter(params.phases.values()))
    fam = family(params.models.denoiser.family)
    scheduler = noise_scheduler(params.models.noise.model_dump())
    bf16 = uses_bf16_autocast(device, cfg.mixed_precision)  # the trainer's switch: both loops alike
    if phase.adapter is None:
        unet = _build_unet(params, device, ckpt, channels_last=False)
    else:
        unet = _plain_lora_unet(params, device, ckpt, bf16)
    trained = [p for p in unet.parameters() if p.requires_grad]
    cond = _random_cond(params, batch).to(device)
    optimizer = torch.optim.AdamW(
        trained, lr=phase.lr, betas=cfg.adam_betas, weight_decay=cfg.weight_decay, eps=cfg.adam_eps
    )
    ema = EMAModel(trained) if phase.adapter is None else None
    if ema is not None:
        ema.to(device)

    def step(latents):
        latents = latents.to(device)
        noise = torch.randn_like(latents)
        timesteps = torch.randint(0, scheduler.config.num_train_timesteps, (latents.shape[0],), device=device)
        noisy = scheduler.add_noise(latents, noise, timesteps)
        if scheduler.config.prediction_type == "epsilon":
            target = noise
        else:
            target = scheduler.get_velocity(latents, noise, timesteps)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            pred = fam.predict(unet, noisy, timesteps, cond)  # the UNet's call; SDXL's with its added conditions
        loss = F.mse_loss(pred.float(), target.float(), reduction="mean")
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trained, cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if ema is not None:
            ema.step(trained)
        float(loss.detach())  # the trainer reads the loss every step (a device sync); so does accelerate's logging

    return step


def _plain_lora_unet(params, device, ckpt, bf16: bool):
    """train_text_to_image_lora_sdxl.py's model: the frozen UNet in bf16 where autocast is on (its ``weight_dtype``),
    a peft LoRA of the phase's rank on the phase's layers (gaussian init) kept in fp32."""
    from peft import LoraConfig

    spec, fam = next(iter(params.phases.values())).adapter, family(params.models.denoiser.family)
    lora = LoraConfig(r=spec.rank, lora_alpha=spec.alpha or spec.rank, init_lora_weights="gaussian",
                      target_modules=target_pattern(spec.targets, fam.lora_groups))  # fmt: skip

    def adapt(unet):
        unet.requires_grad_(False)
        if bf16:
            unet.to(torch.bfloat16)
        unet.add_adapter(lora)
        for p in unet.parameters():  # the script's cast_training_params(unet, dtype=torch.float32)
            if p.requires_grad:
                p.data = p.data.float()

    return _build_unet(params, device, ckpt, False, adapt)


def _plain_flow(params, device, batch, ckpt):
    """diffusers examples/dreambooth/train_dreambooth_sd3.py's loop body: logit-normal σ (mean 0, std 1), the
    straight-line sample, the velocity target, SD3's transformer called with its sequence and pooled inputs."""
    import torch.nn.functional as F
    from diffusers.training_utils import EMAModel

    cfg, phase = params.train, next(iter(params.phases.values()))
    _, config = _family_config(params)
    model = _build_unet(params, device, ckpt, channels_last=False)
    gen = torch.Generator().manual_seed(1)
    sequence = torch.randn(batch, 77, config["joint_attention_dim"], generator=gen).to(device)
    pooled = torch.randn(batch, config["pooled_projection_dim"], generator=gen).to(device)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=phase.lr, betas=cfg.adam_betas, weight_decay=cfg.weight_decay, eps=cfg.adam_eps
    )
    ema = EMAModel(model.parameters())
    ema.to(device)
    bf16 = uses_bf16_autocast(device, cfg.mixed_precision)

    def step(latents):
        latents = latents.to(device)
        noise = torch.randn_like(latents)
        sigmas = torch.sigmoid(torch.randn(latents.shape[0], device=device))
        noisy = (1.0 - sigmas.view(-1, 1, 1, 1)) * latents + sigmas.view(-1, 1, 1, 1) * noise
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            pred = model(hidden_states=noisy, timestep=sigmas * 1000, encoder_hidden_states=sequence,
                         pooled_projections=pooled, return_dict=False)[0]  # fmt: skip
        loss = F.mse_loss(pred.float(), (noise - latents).float(), reduction="mean")
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        ema.step(model.parameters())
        float(loss.detach())

    return step


def flops_per_sample(params) -> float:
    """Forward + backward FLOPs of one training sample (batch 1, 77 text tokens, no checkpoint recomputation;
    counted on ``meta`` through the family's forward call)."""
    fam, config = _family_config(params)
    return fam.flops_per_sample(config, config["sample_size"], *fam.cond_shape(config, 77))

def _reset_peak(device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        with contextlib.suppress(OSError):
            Path("/proc/self/clear_refs").write_text("5")


def _peak_gib(device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20
    return float("nan")


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class Variant:
    """One measured configuration: ``ours`` (with its switches) or ``plain`` at a batch size."""

    name: str
    batch: int
    ckpt: bool
    channels_last: bool = False
    compile: str = "off"
    attention: str = "auto"
    parallel: str = "ddp"
    graphs: str = "off"

    def label(self) -> str:
        """``ours b=32 ckpt=on cl=off compile=blocks attn=auto``."""
        onoff = {True: "on", False: "off"}
        return (
            f"{self.name:5} b={self.batch:<3} ckpt={onoff[self.ckpt]:3} cl={onoff[self.channels_last]:3} "
            f"compile={self.compile:6} attn={self.attention:9}" + (" par=fsdp" if self.parallel == "fsdp" else "")
            + (" graphs=step" if self.graphs == "step" else "")
        )


@dataclass
class Row:
    """A variant's step times, peak memory, and why it stopped if it failed (OOM, compile error)."""

    times: list[float] = field(default_factory=list)
    peak_gib: float = 0.0
    failed: str | None = None
    first_step_s: float = 0.0
    """The first warm-up step of the first round (compilation happens there)."""

    def img_s(self, batch: int) -> float:
        """Images per second from the median timed step (0 if none)."""
        return batch / statistics.median(self.times) if self.times else 0.0


def _make_step(params, device, v: Variant):
    if v.name == "plain":
        return _plain(params, device, v.batch, v.ckpt)
    return _ours(params, device, v.batch, v.ckpt, v.channels_last, v.compile, v.attention, v.parallel, v.graphs)


def _time_variant(params, device, v: Variant, warmup: int, steps: int, row: Row) -> None:
    """Build ``v`` on a fresh model, warm up, time ``steps`` steps into ``row``; failures end up in ``row.failed``."""
    spec = params.models.denoiser_spec
    latents = torch.randn(v.batch, spec["in_channels"], spec["sample_size"], spec["sample_size"])
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    _reset_peak(device)
    torch.manual_seed(0)
    if v.graphs == "step":  # the timed steps are replays: every warm-up call and the capture are untimed
        warmup = max(warmup, WARMUP + 1)
    try:
        step = _make_step(params, device, v)
        for i in range(warmup):
            t0 = time.perf_counter()
            step(latents)
            _sync(device)
            if i == 0 and not row.first_step_s:
                row.first_step_s = time.perf_counter() - t0
        for _ in range(steps):
            t0 = time.perf_counter()
            step(latents)
            _sync(device)
            row.times.append(time.perf_counter() - t0)
        row.peak_gib = max(row.peak_gib, _peak_gib(device))
    except Exception as err:  # noqa: BLE001 - OOM, a compile error: recorded in the table, the sweep goes on
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        row.failed = "OOM" if isinstance(err, torch.OutOfMemoryError) else f"{type(err).__name__}: {first[:120]}"
    finally:
        step = None
        gc.collect()


def measure(params, device, variants: list[Variant], warmup, steps, rounds) -> dict[Variant, Row]:
    """Alternate the variants for ``rounds`` (a failed one is not retried); their rows."""
    rows = {v: Row() for v in variants}
    for _ in range(rounds):
        for v in variants:
            if rows[v].failed is None:
                _time_variant(params, device, v, warmup, steps, rows[v])
    return rows


def sweep(batches, ckpts, cls, compiles, attentions=("auto",), parallels=("ddp",), graphs=("off",)) -> list[Variant]:
    """Per (batch, checkpointing): the plain loop, then ours for each channels_last × compile × attention × parallel
    × CUDA graphs."""
    out = []
    for batch in batches:
        for ckpt in ckpts:
            out.append(Variant("plain", batch, ckpt))
            switches = [(cl, comp, att, par, g) for cl in cls for comp in compiles for att in attentions
                        for par in parallels for g in graphs]  # fmt: skip
            out += [Variant("ours", batch, ckpt, *switch) for switch in switches]
    return out


def _report(rows: dict[Variant, Row], flops: float, peak_tflops: float | None) -> None:
    for v, row in rows.items():
        if row.failed:
            print(f"  {v.label()}: failed ({row.failed})")
            continue
        img_s = row.img_s(v.batch)
        mfu = f"{img_s * flops / (peak_tflops * 1e12):.1%}" if peak_tflops else "n/a"
        plain = rows.get(Variant("plain", v.batch, v.ckpt))
        vs = f"  x{img_s / plain.img_s(v.batch):.3f} plain" if plain and plain.times and v.name == "ours" else ""
        compiled = f"  first step {row.first_step_s:.1f} s" if v.compile != "off" else ""
        eager = rows.get(replace(v, graphs="off")) if v.graphs == "step" else None
        graphed = f"  x{img_s / eager.img_s(v.batch):.3f} graphs off" if eager and eager.times else ""
        print(f"  {v.label()}: {img_s:9.2f} img/s  peak {row.peak_gib:6.2f} GiB  MFU {mfu}{vs}{graphed}{compiled}")


def best_pair(rows: dict[Variant, Row]) -> tuple[Variant, Variant] | None:
    """The fastest ``ours`` variant and the plain loop at its batch and checkpointing (both measured)."""
    pairs = []
    for v, row in rows.items():
        plain = Variant("plain", v.batch, v.ckpt)
        if v.name == "ours" and row.times and rows.get(plain) and rows[plain].times:
            pairs.append((row.img_s(v.batch), v, plain))
    if not pairs:
        return None
    _, ours, plain = max(pairs, key=lambda t: t[0])
    return ours, plain


def _onoff(value: str | None, default: str) -> list[bool]:
    return {"off": [False], "on": [True], "both": [False, True]}[value or default]


def _args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 round of 3 steps (demo: batch 8); under a minute on CPU")
    ap.add_argument("--config", choices=sorted(CONFIGS), help="default: full on CUDA, demo on CPU")
    ap.add_argument("--family", choices=["unet", "mmdit", "sdxl"], help="the denoiser; default: the config's")
    ap.add_argument("--overlay", type=Path, help="a params overlay merged onto the config (configs/full/sdxl.yaml)")
    ap.add_argument("--phase", help="the phase whose lr, Min-SNR and adapter the step takes; default: the first")
    ap.add_argument("--memory-budget-gib", type=float, help="cap the CUDA allocator there (train.memory_budget_gib)")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--batch", help="comma-separated batch sizes (default: 24 for full, 32 for demo; quick 8)")
    ap.add_argument("--ckpt", choices=["off", "on", "both"], help="gradient checkpointing; default: both on CUDA")
    ap.add_argument("--channels-last", choices=["off", "on", "both"], help="ours; default: the config's train value")
    ap.add_argument("--compile", default="off", help="train.compile of ours: comma-separated off, blocks, unet")
    ap.add_argument("--attention", default="auto", help="train.attention of ours: comma-separated auto, cudnn, ...")
    ap.add_argument("--parallel", default="ddp",
                    help="train.parallel of ours: comma-separated ddp, fsdp (one process: the wrapper's own cost)")
    ap.add_argument("--cuda-graphs", default="off", help="train.cuda_graphs of ours: comma-separated off, step")
    ap.add_argument("--steps", type=int, help="timed steps per round")
    ap.add_argument("--rounds", type=int)
    ap.add_argument("--peak-tflops", type=float, help=f"for MFU; default {H100_BF16_DENSE_TFLOPS:g} on CUDA")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = _args(argv)
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda" if cuda else "cpu")
    config = args.config or ("full" if cuda else "demo")
    params = _load(config, args.overlay)
    if args.family:
        params = with_family(params, args.family)
    if args.phase:
        params = with_phase(params, args.phase)
    budget = cap_device_memory(params.train.model_copy(update={"memory_budget_gib": args.memory_budget_gib}), device)
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = params.train.tf32
        torch.backends.cudnn.allow_tf32 = params.train.tf32
    default_batch = 24 if config == "full" else 8 if args.quick else next(iter(params.phases.values())).batch_size
    batches = [int(b) for b in args.batch.split(",")] if args.batch else [default_batch]
    variants = sweep(
        batches,
        _onoff(args.ckpt, "both" if cuda else "off"),
        _onoff(args.channels_last, "on" if params.train.channels_last else "off"),
        args.compile.split(","),
        args.attention.split(","),
        args.parallel.split(","),
        args.cuda_graphs.split(","),
    )
    steps = args.steps or (3 if args.quick else 15)
    rounds = args.rounds or (1 if args.quick else 3)
    warmup = 1 if args.quick else 3
    peak_tflops = args.peak_tflops or (H100_BF16_DENSE_TFLOPS if cuda else None)
    where = machine() + (f", {torch.cuda.get_device_name(device)}" if cuda else "")
    dtype = "bf16 autocast" if uses_bf16_autocast(device, params.train.mixed_precision) else "fp32"
    spec = params.models.denoiser_spec
    flops = flops_per_sample(params)
    print(f"machine: {where}; load {load_average()}; torch {torch.__version__}")
    print(
        f"config: {config} {params.models.denoiser.family} denoiser at {spec['sample_size']}x{spec['sample_size']} "
        "latents, "
        f"{dtype}; {len(variants)} variants; {rounds} round(s) x {steps} timed steps after {warmup} warm-up each"
    )
    print(f"FLOPs per training sample (counted): {flops / 1e12:.4g} TFLOP", end="")
    print(f" (issue's SD1.5 estimate {SD15_TFLOP_PER_SAMPLE_64} TFLOP)" if config == "full" else "")
    print(f"MFU peak: {f'{peak_tflops:g} TFLOP/s' if peak_tflops else 'none on CPU (MFU not reported)'}")
    phase_name, phase = next(iter(params.phases.items()))
    lora = phase.adapter
    adapter = "none" if lora is None else f"{lora.type}-r{lora.rank}-{lora.base_precision}"
    print(f"phase: {phase_name} (adapter {adapter}); memory budget: "
          + (f"{args.memory_budget_gib:g} GiB ({budget:.1%} of the card)" if budget else "none"))
    rows = measure(params, device, variants, warmup, steps, rounds)
    _report(rows, flops, peak_tflops)
    pair = best_pair(rows)
    if pair is None:
        print(result_line("train_step", 0.0, ok=False, device=device.type, config=config, machine=where))
        return
    ours, plain = pair
    o, p = rows[ours], rows[plain]
    print(
        result_line(
            "train_step",
            o.img_s(ours.batch) / p.img_s(plain.batch),
            ours_img_s=o.img_s(ours.batch),
            plain_img_s=p.img_s(plain.batch),
            ours_peak_gib=o.peak_gib,
            plain_peak_gib=p.peak_gib,
            mfu=o.img_s(ours.batch) * flops / (peak_tflops * 1e12) if peak_tflops else 0.0,
            device=device.type,
            config=config,
            family=params.models.denoiser.family,
            batch=ours.batch,
            ckpt="on" if ours.ckpt else "off",
            channels_last="on" if ours.channels_last else "off",
            compile=ours.compile,
            attention=ours.attention,
            parallel=ours.parallel,
            cuda_graphs=ours.graphs,
            phase=phase_name,
            adapter=adapter,
            memory_budget_gib=args.memory_budget_gib or 0.0,
            first_step_s=o.first_step_s,
            machine=where,
        )
    )


if __name__ == "__main__":
    main()
