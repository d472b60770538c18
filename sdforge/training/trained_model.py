"""What a phase trains: every weight of the UNet (:class:`FullUNet`), or a LoRA/DoRA on frozen init weights
(:class:`AdapterUNet`); sharded over the ranks: :class:`sdforge.training.sharded_model.ShardedUNet`. One strategy
object instead of ``if adapter:`` branches: the trained parameters, the live weights a checkpoint holds, and the
folders a finished phase exports. :mod:`sdforge.training.model_setup` builds the phase's.
"""

from __future__ import annotations

import contextlib
import gc
import logging
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from model.adapters import count_parameters
from model.denoisers import DenoiserFamily, family_of
from model.learned_words import LearnedWords
from sdforge.config import Adapter
from sdforge.training.adapter_files import UNET_FILE, write_learned_words, write_lora_folder, write_plain_unet
from sdforge.training.checkpoints import CheckpointError
from sdforge.training.distributed import Dist

log = logging.getLogger(__name__)

ADAPTER_DIR, ADAPTER_WEIGHTS = "adapter", "adapter_weights.safetensors"
"""An adapter phase's checkpoint holds the trained tensors only: ``adapter/adapter_weights.safetensors``."""
WORDS_PREFIX = "learned_words"
"""The learned words' tensors among an adapter checkpoint's trained tensors: ``learned_words.vectors`` (the first
text encoder's), ``learned_words.vectors_2`` (the second's, sdxl and mmdit)."""


class FullUNet:
    """Every UNet weight is trained; checkpoints and exports are diffusers UNet folders."""

    sharded = False
    """Whether the weights are ``DTensor`` shards (:class:`ShardedUNet`)."""
    activation_profile = None
    """What the model keeps for the backward per checkpoint unit, measured before training
    (:class:`model.activation_memory.ActivationProfile`; None unless a memory plan needs it)."""

    def __init__(self, unet: torch.nn.Module, dist: Dist):
        self.unet = unet
        self.trainable = [p for _, p in self.named_trainable()]
        """What the optimizer, gradient clipping and the EMA see."""
        self.forward_module = self._forward_module(unet, dist)
        """``unet`` itself on one process, else its DistributedDataParallel wrapper."""
        self.world = dist.world

    def _forward_module(self, unet: torch.nn.Module, dist: Dist) -> torch.nn.Module:
        return _wrap_ddp(unet, dist)

    def named_trainable(self) -> list[tuple[str, torch.nn.Parameter]]:
        """The trained weights by name, in a fixed order."""
        return [(n, p) for n, p in self.unet.named_parameters() if p.requires_grad]

    def reduce_outside_gradients(self) -> None:
        """Average over the ranks the gradients DDP does not reduce (none here: every weight is in the UNet)."""

    def no_sync(self, sync: bool):
        """DDP's ``no_sync()`` for a micro-batch whose gradients are not all-reduced yet (else a null context)."""
        return self.forward_module.no_sync() if (self.world > 1 and not sync) else contextlib.nullcontext()

    def controlled(self, image: torch.Tensor | None):
        """The micro-batch's forward under its conditioning image: a null context (no ControlNet here)."""
        return contextlib.nullcontext()

    def parameter_counts(self) -> dict:
        """``trainable_params`` (what the optimizer updates), ``unet_params`` (the UNet without adapters), share."""
        trainable, base = count_parameters(self.unet)
        return {"trainable_params": trainable, "unet_params": base, "trainable_share": round(trainable / base, 6)}

    def live_tensors(self) -> dict[str, torch.Tensor]:
        """What a checkpoint keeps of the live weights, by name (references: copy them to keep them)."""
        return self.unet.state_dict()

    def write_live(self, ckpt: Path, tensors: dict[str, torch.Tensor] | None = None) -> None:
        """The live weights (``tensors``, default :meth:`live_tensors`) into checkpoint folder ``ckpt``: ``unet/``
        as a diffusers folder (``config.json`` + safetensors), what ``from_pretrained`` reads."""
        folder = ckpt / "unet"
        folder.mkdir(parents=True)
        self.unet.save_config(folder)
        tensors = self.live_tensors() if tensors is None else tensors
        save_file({k: v.contiguous() for k, v in tensors.items()}, folder / UNET_FILE, metadata={"format": "pt"})

    def load_live(self, ckpt: Path) -> None:
        """Inverse of :meth:`write_live`; a CheckpointError naming the folder when they do not fit."""
        live = checkpoint_unet_weights(ckpt / "unet", family_of(self.unet))
        try:
            self.unet.load_state_dict(live)
        except (RuntimeError, ValueError) as err:
            raise CheckpointError(f"{ckpt / 'unet'}: does not fit this run's UNet ({first_line(err)})") from err

    def export(self, out_dir: Path, unet_dir: str, adapter_dir: str) -> None:
        """The UNet's current weights as ``out_dir/unet_dir``."""
        self.unet.save_pretrained(out_dir / unet_dir, safe_serialization=True)

    def describe(self) -> dict:
        """What ``state.json`` says of the trained weights beyond the phase's figures (nothing for a full UNet)."""
        return {}

    def release(self) -> None:
        """Drop the DDP wrapper (its reducer holds the process group) so the group can be torn down."""
        self.forward_module = None
        gc.collect()


class AdapterUNet(FullUNet):
    """A LoRA/DoRA on frozen init weights: checkpoints hold its tensors only; exports are diffusers LoRA files
    plus plain UNets (merged or the base: ``adapter.merge``; :mod:`sdforge.training.adapter_files`)."""

    def __init__(self, unet: torch.nn.Module, dist: Dist, spec: Adapter, words: LearnedWords | None = None,
                 text_lora: dict[str, torch.nn.Module] | None = None):  # fmt: skip
        self.spec, self.words, self.text_lora = spec, words, text_lora or {}
        """``words``: the text encoder's learned rows (``adapter.words``); ``text_lora``: the text encoders with a
        LoRA (``adapter.text_encoders``, by folder name). Both are trained, saved and exported with the adapter."""
        super().__init__(unet, dist)

    def named_trainable(self) -> list[tuple[str, torch.nn.Parameter]]:
        """The adapter's tensors, the learned words' vectors (``learned_words.vectors``, ``…vectors_2``), then each
        adapted text encoder's LoRA tensors (``text_encoder.<name>``, ``text_encoder_2.<name>``)."""
        return super().named_trainable() + self._text_trainable()

    def _text_trainable(self) -> list[tuple[str, torch.nn.Parameter]]:
        """The trained tensors outside the UNet: the learned words', then the text encoders' LoRA."""
        words = [] if self.words is None else [(f"{WORDS_PREFIX}.{n}", p) for n, p in self.words.named_parameters()]
        return words + [(f"{name}.{n}", p) for name, encoder in self.text_lora.items()
                        for n, p in encoder.named_parameters() if p.requires_grad]  # fmt: skip

    def parameter_counts(self) -> dict:
        """As for a full UNet, ``trainable_params`` counting the learned words and the text encoders' LoRA too
        (``text_lora_params``)."""
        counts = super().parameter_counts()
        outside = sum(p.numel() for _, p in self._text_trainable())
        counts["trainable_params"] += outside
        counts["trainable_share"] = round(counts["trainable_params"] / counts["unet_params"], 6)
        if self.text_lora:
            word_tables = [] if self.words is None else self.words.tables()
            counts["text_lora_params"] = outside - sum(t.numel() for t in word_tables)
        quantised = getattr(self.unet, "sdforge_quantisation", {})  # adapter.base_precision: nf4 / int8
        counts.update({f"quantisation.{k}": v for k, v in quantised.items()})
        return counts

    def reduce_outside_gradients(self) -> None:
        """The learned words and the text encoders' LoRA live outside the DDP-wrapped UNet: average their gradients
        here (after the step's last micro-batch, as DDP does for the UNet's). A tensor no batch of the step reached
        gets a zero gradient, on every world size: the optimizer then steps it as it steps every other weight
        (a None gradient would skip it on one process and not on another, and every rank joins the reduction)."""
        for _, tensor in self._text_trainable():
            if tensor.grad is None:
                tensor.grad = torch.zeros_like(tensor)
            if self.world > 1:
                torch.distributed.all_reduce(tensor.grad)
                tensor.grad /= self.world

    def live_tensors(self) -> dict[str, torch.Tensor]:
        """The trained tensors by name (the frozen base is the init's)."""
        return {n: p.detach() for n, p in self.named_trainable()}

    def write_live(self, ckpt: Path, tensors: dict[str, torch.Tensor] | None = None) -> None:
        """``adapter/adapter_weights.safetensors``: the trained tensors (``tensors``, default :meth:`live_tensors`)."""
        (ckpt / ADAPTER_DIR).mkdir(parents=True)
        tensors = self.live_tensors() if tensors is None else tensors
        save_file({n: t.cpu().contiguous() for n, t in tensors.items()}, ckpt / ADAPTER_DIR / ADAPTER_WEIGHTS)

    def load_live(self, ckpt: Path) -> None:
        path = ckpt / ADAPTER_DIR / ADAPTER_WEIGHTS
        try:
            saved = load_file(path)
        except Exception as err:
            raise CheckpointError(f"{path}: cannot read the adapter weights ({first_line(err)})") from err
        mine = dict(self.named_trainable())
        if set(saved) != set(mine) or any(saved[n].shape != p.shape for n, p in mine.items()):
            raise CheckpointError(f"{path}: not this phase's adapter (its tensors differ from adapter: in params)")
        with torch.no_grad():
            for name, param in mine.items():
                param.copy_(saved[name])

    def export(self, out_dir: Path, unet_dir: str, adapter_dir: str) -> None:
        """``out_dir/adapter_dir`` (diffusers LoRA file) and ``out_dir/unet_dir`` (plain UNet)."""
        write_lora_folder(self.unet, out_dir / adapter_dir, self.text_lora)
        if self.words is not None:
            for index, vectors in enumerate(self.words.as_dicts()):
                write_learned_words(vectors, out_dir / adapter_dir, index)
        write_plain_unet(self.unet, out_dir / unet_dir, merge=self.spec.merge)

    def describe(self) -> dict:
        return {"adapter": self.spec.model_dump()}


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


def checkpoint_unet_weights(unet_dir: Path, denoiser_family: DenoiserFamily) -> dict[str, torch.Tensor]:
    """The live UNet state dict of a training checkpoint, from safetensors only; a CheckpointError naming the dir."""
    if not any(unet_dir.glob("*.safetensors")):
        found = sorted(p.name for p in unet_dir.iterdir()) if unet_dir.is_dir() else []
        raise CheckpointError(
            f"{unet_dir}: no .safetensors weights (found {found or 'nothing'}); other formats are never loaded"
        )
    try:
        return denoiser_family.model_class().from_pretrained(unet_dir, use_safetensors=True).state_dict()
    except Exception as err:
        raise CheckpointError(f"{unet_dir}: cannot load the UNet ({first_line(err)})") from err


def first_line(err: BaseException) -> str:
    """The first line of an error's message (library messages can run to many lines)."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
