"""``train``: the optimisation settings shared by every phase, one :class:`Section` per concern.

The keys stay flat in ``params.yaml`` (``train.keep_last``): :class:`Train` inherits every concern's fields.
Each concern says what changing its keys changes (``EFFECT``, :class:`sdforge.config.Effect`).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BeforeValidator, Field, model_validator

from sdforge.config.base import Effect, S3Url, Section, Url


class TrainingRecipe(Section):
    """What is trained and in which order: the seed, the bucket tail and the default objective."""

    seed: int = 0
    bucket_tail: Literal["drop", "carry"] = "drop"
    """With several aspect buckets: a bucket's samples left over after its last full global batch are
    dropped for the epoch, or carried to the front of that bucket in the next epoch."""
    objective: Literal["diffusion", "flow_matching"] = "diffusion"
    """The default of ``phases.<p>.objective`` (one key switches every phase that does not set its own)."""
    held_out: int = Field(0, ge=0)
    """Samples of every source that ``mix_phase`` splits off and no phase trains on: the same keys in every phase
    (:func:`sdforge.latents.mix.held_out_keys`), written to ``<phase>.held_out.parquet`` for the validation loss
    (``val_loss_every``). 0: no held-out set, no validation loss."""


class OptimizerSettings(Section):
    """AdamW's settings (every phase's optimizer) and gradient clipping."""

    adam_betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = Field(1e-8, gt=0)
    weight_decay: float = Field(1e-2, ge=0)
    grad_clip: float = Field(1.0, gt=0)


class EmaSettings(Section):
    """The exponential moving average of the UNet's weights (what the eval grid and the next phase use)."""

    ema_decay: float = Field(0.9999, gt=0, lt=1)
    ema_update_every: int = Field(1, ge=1)
    """Update the EMA every N optimizer steps (with decay adjusted for the N steps)."""
    ema_device: Literal["model", "cpu"] = "model"
    """Where the EMA weights live: with the model (GPU), or on CPU to save GPU memory."""
    posthoc_sigma_rels: list[Annotated[float, Field(gt=0, lt=0.2886)]] = []
    """Post-hoc EMA (EDM2, :mod:`model.posthoc_ema`): the relative widths of the power-function EMAs tracked while
    training (EDM2: ``[0.05, 0.10]``; at least two), beside the fixed-decay EMA and where it lives. [] : off. At the
    phase's end each of ``posthoc_candidates`` is rebuilt from the snapshots and scored, with the fixed EMA, by
    the validation loss (``held_out`` > 0 needed); the best is exported as ``unet_ema/`` (docs/EVAL.md)."""
    posthoc_snapshots: int = Field(8, ge=2)
    """Snapshots of the tracked EMAs per phase, evenly spaced in its steps (the last at its end); each holds every
    tracked EMA in fp32, in the run dir's ``posthoc/``."""
    posthoc_candidates: list[Annotated[float, Field(gt=0, lt=0.2886)]] = [0.025, 0.05, 0.075, 0.1, 0.15, 0.2]
    """The σ_rel rebuilt and scored at a phase's end."""


def _on_off(value):
    """YAML reads a bare ``on``/``off`` as a boolean: take it as the word."""
    return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value


class PrecisionSettings(Section):
    """Numerics and memory layout: autocast, TF32, the text encoder's dtype, checkpointing, determinism."""

    mixed_precision: Literal["no", "bf16"] = "bf16"
    """bf16 autocast on CUDA, and on a CPU with native bf16 (AVX512-BF16/AMX); fp32 elsewhere."""
    tf32: bool = True
    """Allow TF32 matmuls/convolutions on CUDA."""
    text_encoder_dtype: Literal["fp32", "bf16"] = "bf16"
    """The frozen text encoder's dtype on CUDA (CPU: fp32)."""
    channels_last: bool = False
    compile: Literal["off", "blocks", "unet"] = "off"
    """``torch.compile``: ``blocks`` compiles the UNet's repeated ResNet and transformer blocks (regional
    compilation: each block shape once, far less compile time than the whole model), ``unet`` the whole UNet
    module; in place, static shapes, with DDP, gradient checkpointing, adapters and the EMA (:mod:`model.speed`).
    The compile seconds go to the train metrics (``compile.seconds``). Pays on CUDA; a CPU compiles slowly."""
    cuda_graphs: Annotated[Literal["off", "step"], Effect.JOB, BeforeValidator(_on_off)] = "off"
    """``step``: each micro-batch's forward + backward (one graph per bucket shape) and the optimizer step (clip,
    capturable fused AdamW with its LR in a device tensor) are captured as CUDA graphs after 3 eager warm-up calls
    on a side stream, and replayed from static input buffers the loader's batches are copied into; the LR schedule,
    EMA and post-hoc EMA run outside. On a CPU the same static-buffer step runs without capture (bit-identical to
    ``off``). Needs one rank, AdamW, no distillation, and not FSDP (refused by name otherwise). The job's shape,
    not the weights': a run resumes across a change (docs/SPEED.md "CUDA graphs")."""
    attention: Literal["auto", "cudnn", "flash", "efficient", "math"] = "auto"
    """The UNet's scaled-dot-product-attention kernel: ``auto`` (torch chooses) or that backend only; the CUDA
    kernels (cudnn, flash, efficient) fall back to ``auto`` on a CPU."""
    deterministic: bool = False
    """``torch.use_deterministic_algorithms`` (warn-only: ops without a deterministic kernel warn, not fail),
    cuDNN autotuning off and ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` unless set: on CUDA a killed and resumed run
    then repeats the uninterrupted one bit for bit where every kernel allows. Slower; CPU is deterministic anyway.
    Measured on an H200 (bench/README.md, 2026-11-27): with ``attention: auto`` two uninterrupted full-size runs
    already differed at step 30 (loss 1.99391 vs 1.99442); with ``attention: math`` a run killed at step 40 and
    resumed matched the uninterrupted one bit for bit (80 steps: loss and all 1,372 tensors). So on CUDA
    ``deterministic`` turns ``attention: auto`` into ``math`` (logged; slower, more memory); an explicit
    flash/efficient/cudnn is kept, with a warning."""


class CheckpointSettings(Section):
    """When checkpoints are written, which are kept, and where they are uploaded (retention: not the weights)."""

    EFFECT = Effect.NONE

    save_steps: int = Field(0, ge=0)
    """Mid-epoch checkpoint every N optimizer steps (0: epoch ends only)."""
    keep_last: int = Field(2, ge=1)
    """Retention: the newest K checkpoints of a phase's run are kept ..."""
    keep_every: int = Field(0, ge=0)
    """... plus every checkpoint whose step is a multiple of N (0: none) ..."""
    keep_best: bool = True
    """... plus the one with the lowest mean training loss since the previous checkpoint."""
    checkpoint_s3: S3Url | None = None
    """``s3://bucket/prefix``: every checkpoint is uploaded there as it is written, and a fresh pod
    resumes from the newest of local disk and S3 (endpoint from ``AWS_ENDPOINT_URL`` if set)."""
    async_checkpoint: Annotated[Literal["auto", "on", "off"], BeforeValidator(_on_off)] = "auto"
    """on: at the step boundary the state is copied to host memory (pinned, reused buffers on CUDA) and the
    files, hashes, manifest and upload are written in the background while training goes on (one write in
    flight; ``COMPLETE`` last). off: the step waits for the whole write. auto: on with CUDA; on a CPU only
    while a second copy of the state fits in free memory (else off, logged). docs/RESILIENCE.md."""


class ReportingSettings(Section):
    """What the run reports while it trains: step logs, validation images, the progress bar."""

    EFFECT = Effect.NONE

    log_every: int = Field(10, ge=1)
    validation_every: int = Field(0, ge=0)
    """Every N optimizer steps (0: never) sample the first ``validation_prompts`` eval prompts with the
    EMA weights and log a captioned grid to MLflow as ``validation/step-NNNNNNNN.png``."""
    validation_prompts: int = Field(4, ge=1)
    val_loss_every: int = Field(0, ge=0)
    """The validation loss on the phase's held-out samples (``held_out``), EMA weights, every N optimizer steps
    and at the phase's end (0: at the end only): the objective's unweighted MSE at ``val_loss_timesteps`` fixed
    noise levels with fixed noise per sample (:mod:`model.held_out_loss`, docs/EVAL.md)."""
    val_loss_timesteps: int = Field(8, ge=1)
    """Noise levels of the validation loss, evenly spaced: ``(k + 0.5) / K`` (σ, or that fraction of T)."""
    val_loss_batch: int = Field(32, ge=1)
    """Held-out samples per forward pass of the validation loss."""
    progress_bar: bool = True
    """tqdm bar with ETA on the main rank."""


class LaunchSettings(Section):
    """The job's shape: processes per node, nodes, this node's rank and the rendezvous (``torchrun``)."""

    EFFECT = Effect.JOB

    nproc_per_node: int = Field(1, ge=1)
    """Processes (GPUs) per node; > 1 (or nnodes > 1) makes the stage launch ``torchrun``."""
    nnodes: int = Field(1, ge=1)
    node_rank: int = Field(0, ge=0)
    rdzv_endpoint: Url | None = None
    """``host:port`` of the rendezvous (required when nnodes > 1)."""
    parallel: Literal["ddp", "fsdp", "auto"] = "auto"
    """How the ranks hold the model: ``ddp`` replicates the weights, gradients, optimizer and EMA on every rank;
    ``fsdp`` shards them over the ranks (FSDP2, one unit per block of the family's denoiser) and checkpoints
    with torch.distributed.checkpoint; ``auto`` picks fsdp only where the replicated state would leave less
    than half the card for the batch (logged; ddp on a CPU and on one process). A run resumes across a change,
    and on another world size (docs/PARALLEL.md)."""

    @model_validator(mode="after")
    def _node_rank_in_range(self) -> LaunchSettings:
        if self.node_rank >= self.nnodes:
            raise ValueError(f"train.node_rank {self.node_rank} must be < train.nnodes {self.nnodes}")
        return self


class MemorySettings(Section):
    """What a rank keeps for the backward, and the memory it plans for (:mod:`sdforge.training.memory_plan`,
    docs/MEMORY.md). Recomputing activations does not change the weights, and ``auto`` keeps the global batch
    through accumulation: the job's shape (a run resumes across a change)."""

    EFFECT = Effect.JOB

    activation_checkpointing: Literal["off", "full", "selective", "auto"] = "off"
    """Recompute activations in the backward (non-reentrant), by checkpoint unit (the UNet's down/mid/up blocks;
    an MM-DiT as a whole): ``full`` every unit (~20 % slower, 2.4–3× less peak memory on SD1.5); ``selective`` the
    fewest units, by activation bytes saved per recomputed FLOP (the 64×64 level first), that fit the configured
    micro-batch in ``memory_budget_gib`` (no budget: those whose recompute stays within a third of the forward);
    ``auto`` the units and the micro-batch (≤ ``phases.<p>.batch_size``, the global batch kept through
    accumulation) with the best forecast speed that fits the budget. Both measure the model's activations at the
    start (batch 1 and 2). ``gradient_checkpointing: true``, the older key, reads as ``full``."""
    memory_budget_gib: float | None = Field(None, gt=0)
    """The memory one rank may use, GiB (null: the card's total; on a CPU none, so ``auto`` checkpoints nothing).
    ``auto``/``selective`` plan for 90 % of it (fragmentation, CUDA's own); on CUDA it is also the allocator's hard
    limit (``set_per_process_memory_fraction``): a smaller card, emulated."""

    @model_validator(mode="before")
    @classmethod
    def _older_key(cls, data):
        """``gradient_checkpointing: true|false`` (before ``activation_checkpointing``) reads as ``full``/``off``."""
        if not isinstance(data, dict) or "gradient_checkpointing" not in data:
            return data
        data = dict(data)
        older = data.pop("gradient_checkpointing")
        if not isinstance(older, bool):
            raise ValueError("train.gradient_checkpointing: true or false (or use train.activation_checkpointing)")
        now = data.get("activation_checkpointing")
        if now is not None and now != ("full" if older else "off"):
            raise ValueError(f"train.gradient_checkpointing {older} and train.activation_checkpointing {now} "
                             "disagree: keep activation_checkpointing only")  # fmt: skip
        data["activation_checkpointing"] = "full" if older else "off"
        return data


class ResilienceSettings(Section):
    """Failure handling: a graceful stop on preemption and the hang watchdog (docs/RESILIENCE.md)."""

    EFFECT = Effect.NONE

    preempt_grace_s: float = Field(25.0, gt=0)
    """On SIGTERM (a Kubernetes pod deletion, a spot/preemptible notice) the ranks stop at the next step
    boundary and write a checkpoint if it fits in this many seconds from the signal (estimated from the
    measured write time); otherwise they keep the last good one. Set it a few seconds under the pod's
    ``terminationGracePeriodSeconds`` (30 by default). docs/RESILIENCE.md."""
    hang_timeout_s: float | None = Field(None, gt=0)
    """A rank whose step (or collective) makes no progress for this long dumps every thread's stack into the
    stage log, names the lagging rank(s) and exits non-zero (the orchestrator retries from the last
    checkpoint). null: 20 × the slowest step so far, at least 300 s; checkpoints and validation get 10 × it."""


class Train(
    TrainingRecipe,
    OptimizerSettings,
    EmaSettings,
    PrecisionSettings,
    MemorySettings,
    CheckpointSettings,
    ReportingSettings,
    LaunchSettings,
    ResilienceSettings,
):
    """Optimisation settings shared by every phase, flat under ``train`` and grouped by concern:

    - :class:`TrainingRecipe`, :class:`OptimizerSettings`, :class:`EmaSettings`, :class:`PrecisionSettings`:
      the weights a run trains (:attr:`Effect.WEIGHTS`); a run dir from other values is not resumed.
    - :class:`CheckpointSettings`, :class:`ReportingSettings`, :class:`ResilienceSettings`: retention,
      reporting and failure handling (:attr:`Effect.NONE`); a run resumes across a change, bit-identically.
    - :class:`LaunchSettings`, :class:`MemorySettings`: the job's shape (:attr:`Effect.JOB`); a run resumes on
      another world size, or with other checkpointing, with its global batch kept (docs/RESILIENCE.md).

    :func:`sdforge.config.keys_by_effect` lists every key's effect."""

    EFFECT = Effect.WEIGHTS  # not CheckpointSettings' NONE, which the MRO would find first; no key is declared here

    @model_validator(mode="after")
    def _posthoc_needs_two_profiles_and_a_held_out_set(self) -> Train:
        if not self.posthoc_sigma_rels:
            return self
        if len(set(self.posthoc_sigma_rels)) < 2:
            raise ValueError("train.posthoc_sigma_rels: track at least two distinct σ_rel (EDM2: [0.05, 0.10]), or []")
        if self.held_out == 0:
            raise ValueError("train.posthoc_sigma_rels: the rebuilt EMAs are scored by the validation loss; set "
                             "train.held_out > 0 (samples of every source held out of training)")  # fmt: skip
        return self
