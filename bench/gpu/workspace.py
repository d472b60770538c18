"""A training workspace built without the data stages: local demo models, synthetic latents, a phase index.

The GPU machine has no network, no polars and no MLflow, so nothing here downloads, reads polars or
tracks: ``prepare_models`` builds the demo tokenizer, text encoder and VAE locally (the text encoder's
width follows the UNet's ``cross_attention_dim``), the UNet is whatever ``unet`` says (the full config's
SD1.x UNet by default), the latent store holds ``samples`` seeded Gaussian latents, and the phase index
(``source, shard, row, key``, as ``mix_phase`` writes it) is written with pyarrow. ``tracking.enabled`` is
false. The result is a params file that ``python -m stages.train --params <file> --item phase1`` trains.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch
import yaml

from sdforge.config import parse_params
from sdforge.latents.store import MANIFEST, shard_path, write_shard
from stages import prepare_models

REPO = Path(__file__).resolve().parents[2]
FULL_PARAMS = REPO / "configs/full/params.yaml"
DEMO_PARAMS = REPO / "params.yaml"
SOURCE = "laion"
PHASE = "phase1"
RESOLUTION, BUCKET = "square", (64, 64)
TOKENS = 77
"""Token ids per caption in the synthetic store, and the text encoder's positions: SD's 77 (the demo's own 16 would
make the full-size check's cross-attention cheaper than real training)."""
"""The synthetic store's one bucket set and bucket: a label only (the latents are written, not encoded)."""
TINY_UNET = {
    "sample_size": 8,
    "block_out_channels": [16, 32],
    "layers_per_block": 1,
    "down_block_types": ["CrossAttnDownBlock2D", "DownBlock2D"],
    "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D"],
    "cross_attention_dim": 32,
    "attention_head_dim": 4,
    "norm_num_groups": 8,
}
"""A tiny UNet on 8×8 latents: the train check's ``--quick`` (CPU rehearsal) and the tests' tiny workspaces."""


CHANNEL_MEANS = (0.8, -0.6, 0.4, -0.2)
"""The synthetic latents' per-channel means (:func:`write_latents`)."""


def full_unet() -> dict:
    """The full configuration's ``models.unet`` (the 859,520,964-parameter SD1.x UNet at 64×64 latents)."""
    return yaml.safe_load(FULL_PARAMS.read_text())["models"]["unet"]


def workspace_params(root: Path, unet: dict, samples: int, train: dict, phase: dict) -> dict:
    """The demo params with every path under ``root``, ``unet`` as the UNet, tracking off, one phase."""
    data = yaml.safe_load(DEMO_PARAMS.read_text())
    data["paths"] = {k: str(root / v) for k, v in data["paths"].items()}
    data["tracking"]["enabled"] = False
    data["buckets"] = {RESOLUTION: {"sizes": [list(BUCKET)], "step": BUCKET[0]}}  # the store's one (label) bucket
    data["encode"]["resolutions"] = [RESOLUTION]
    for phase_cfg in data["phases"].values():
        phase_cfg.pop("resolution", None)
    data["models"]["unet"] = {**unet, "in_channels": 4, "out_channels": 4}
    data["models"]["vae_build"].update(train_steps=1, block_out_channels=[8, 16], batch_size=4)
    data["models"]["text_encoder_build"].update(
        hidden_size=unet["cross_attention_dim"],
        intermediate_size=4 * unet["cross_attention_dim"],
        num_hidden_layers=1,
        max_position_embeddings=TOKENS,
    )
    data["train"].update(validation_every=0, held_out=0, posthoc_sigma_rels=[], progress_bar=False, **train)
    base = {"mix": {SOURCE: 1.0}, "samples": samples, "with_replacement": False, "init_from": "scratch"}
    data["phases"] = {PHASE: {**base, **phase}}
    return data


def write_latents(latents_dir: Path, samples: int, size: int, seed: int = 0) -> None:
    """One shard of ``samples`` seeded latents ``[4, size, size]`` with token ids, and its manifest. Each channel is
    N(μ_c, 0.5²) around a fixed mean (:data:`CHANNEL_MEANS`), so training has something to learn quickly: from pure
    N(0, 1) latents the flow-matching loss can fall only a few per cent below its start, and the tiny CPU
    rehearsal's 40 steps did not show it (2026-11-28)."""
    gen = torch.Generator().manual_seed(seed)
    means = torch.tensor(CHANNEL_MEANS).view(1, 4, 1, 1)
    latents = means + 0.5 * torch.randn(samples, 4, size, size, generator=gen)
    ids = torch.randint(0, 500, (samples, TOKENS), generator=gen)
    path = shard_path(latents_dir, SOURCE, RESOLUTION, 0, BUCKET)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_shard(path, latents, ids)
    keys = [f"{i:06d}" for i in range(samples)]
    table = pa.table(
        {
            "key": keys,
            "caption": ["synthetic"] * samples,
            "source": [SOURCE] * samples,
            "shard": [0] * samples,
            "bucket_width": [BUCKET[0]] * samples,
            "bucket_height": [BUCKET[1]] * samples,
            "row": list(range(samples)),
        }
    )
    pq.write_table(table, path.parent / MANIFEST)


def write_index(mixes_dir: Path, samples: int) -> None:
    """The phase index over every sample of the store, in order (``mix_phase``'s columns)."""
    mixes_dir.mkdir(parents=True, exist_ok=True)
    table = pa.table(
        {
            "source": [SOURCE] * samples,
            "shard": pa.array([0] * samples, pa.int64()),
            "bucket_width": pa.array([BUCKET[0]] * samples, pa.int32()),
            "bucket_height": pa.array([BUCKET[1]] * samples, pa.int32()),
            "row": pa.array(range(samples), pa.int64()),
            "key": [f"{i:06d}" for i in range(samples)],
        }
    )
    pq.write_table(table, mixes_dir / f"{PHASE}.parquet")


def build(root: Path, unet: dict, samples: int, train: dict, phase: dict) -> Path:
    """Models, latents and the phase-1 index under ``root``; returns the params file to train with."""
    root.mkdir(parents=True, exist_ok=True)
    data = workspace_params(root, unet, samples, train, phase)
    params = parse_params(data)
    models_dir = Path(params.paths.models)
    prepare_models.run(params.models, params.demo, params.eval, models_dir, Path(params.paths.checkpoints) / "scratch")
    write_latents(Path(params.paths.latents), samples, unet["sample_size"])
    write_index(Path(params.paths.mixes), samples)
    path = root / "params.yaml"
    path.write_text(yaml.safe_dump(data))
    return path
