"""The trained model sharded over the ranks (``train.parallel: fsdp``): :class:`ShardedUNet`, the strategy object
whose weights, gradients, optimizer moments and EMA are ``DTensor`` shards (:mod:`model.sharding`)."""

from __future__ import annotations

import contextlib
import gc
from pathlib import Path

import torch

from model.denoisers import family_of
from model.sharding import set_gradient_sync
from sdforge.training.checkpoints import CheckpointError
from sdforge.training.distributed import Dist
from sdforge.training.sharded_state import SHARDS_DIR, distribute_like, gathered
from sdforge.training.trained_model import FullUNet, checkpoint_unet_weights


class ShardedUNet(FullUNet):
    """Every weight trained, sharded over the ranks (``train.parallel: fsdp``, :mod:`model.sharding`): the weights,
    gradients, optimizer moments and EMA are ``DTensor`` shards. Checkpoints hold them as DCP files
    (:mod:`sdforge.training.sharded_state`); the export gathers the whole weights on the main rank first."""

    sharded = True

    def __init__(self, unet: torch.nn.Module, dist: Dist, units: int):
        self.units = units
        """Modules sharded one by one (the family's blocks and the root)."""
        super().__init__(unet, dist)

    def _forward_module(self, unet: torch.nn.Module, dist: Dist) -> torch.nn.Module:
        return unet  # sharding wraps the module in place

    def no_sync(self, sync: bool):
        """No gradient reduce-scatter for a micro-batch that is not the step's last (FSDP2's gradient sync switch)."""
        set_gradient_sync(self.unet, sync)
        return contextlib.nullcontext()

    def write_live(self, ckpt: Path, tensors=None) -> None:
        """Move the shards every rank wrote for this checkpoint (``tensors``: their staging folder) into it."""
        Path(tensors).rename(ckpt / SHARDS_DIR)

    def load_live(self, ckpt: Path) -> None:
        """A replicated checkpoint's ``unet/`` cut into this rank's shards (a sharded one is read with the rest of
        the state: :meth:`sdforge.training.checkpoint_restore.CheckpointRestore.restore`)."""
        live = checkpoint_unet_weights(ckpt / "unet", family_of(self.unet))
        mine = self.unet.state_dict()
        if set(live) != set(mine) or any(live[k].shape != mine[k].shape for k in mine):
            raise CheckpointError(f"{ckpt / 'unet'}: does not fit this run's UNet (other tensors or shapes)")
        with torch.no_grad():
            for name, shard in distribute_like(live, mine).items():
                mine[name].to_local().copy_(shard.to_local())

    def gather_for_export(self, ema) -> None:
        """Every rank: gather the whole live weights and EMA onto the main rank, which then holds a plain
        (unsharded) copy of the model in :attr:`unet` and whole shadow weights in ``ema`` (what the export reads);
        the other ranks drop their shards. Memory on the main rank: the weights twice, on the CPU."""
        main = self.world == 1 or torch.distributed.get_rank() == 0
        live = {name: gathered(t, main) for name, t in self.unet.state_dict().items()}
        shadows = [gathered(t, main) for t in ema.shadow_params]
        if not main:
            return
        plain = family_of(self.unet).model_class().from_config(self.unet.config)
        plain.load_state_dict(live)
        self.unet, self.trainable = plain, list(plain.parameters())
        ema.shadow_params = shadows
        gc.collect()
