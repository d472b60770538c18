"""A phase's input declaration (:mod:`sdforge.training.inputs`): which params and files it records, what the
fingerprint reacts to, and the differences it names — against hand-built params, no training."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sdforge.config import Effect, Train, keys_by_effect, parse_params
from sdforge.latents.store import part_name
from sdforge.training.inputs import INPUT_FILES, InputRecord, latent_shards_digest, phase_inputs, weight_params
from tests.fixtures.training import tiny_params


@pytest.fixture
def params_data(tmp_path):
    return tiny_params(tmp_path)


def test_the_weight_params_are_the_weight_keys_of_train_and_the_phase_and_every_model_key(params_data):
    got = weight_params(parse_params(params_data), "phase1")
    train_keys = {k.removeprefix("train.") for k in got if k.startswith("train.")}
    assert train_keys == {k for k, e in keys_by_effect(Train).items() if e is Effect.WEIGHTS}
    assert {"train.keep_last", "train.save_steps", "train.checkpoint_s3", "train.nproc_per_node"}.isdisjoint(got)
    assert "phases.phase1.lr" in got and "phases.phase1.description" not in got
    assert not any(k.startswith("phases.phase2.") for k in got)
    assert {"models.unet.block_out_channels", "models.noise.prediction_type"} <= set(got)


def _fingerprint(data: dict) -> str:
    return InputRecord(weight_params(parse_params(data), "phase1"), {}).fingerprint


@pytest.mark.parametrize(
    ("section", "key", "value", "changes"),
    [
        ("train", "keep_last", 7, False),
        ("train", "save_steps", 5, False),
        ("train", "checkpoint_s3", "s3://bucket/ckpts", False),
        ("train", "nproc_per_node", 4, False),
        ("train", "validation_every", 3, False),
        ("train", "seed", 1, True),
        ("train", "ema_decay", 0.5, True),
        ("train", "grad_clip", 0.5, True),
        ("phase1", "lr", 5e-4, True),
        ("phase1", "description", "words", False),
        ("phase2", "lr", 5e-4, False),  # another phase's key
        ("noise", "beta_end", 0.02, True),
    ],
)
def test_the_fingerprint_follows_exactly_the_weight_keys(params_data, section, key, value, changes):
    before = _fingerprint(params_data)
    target = {"train": params_data["train"], "noise": params_data["models"]["noise"]}.get(section)
    (target if target is not None else params_data["phases"][section])[key] = value
    assert (_fingerprint(params_data) != before) is changes


def test_differences_name_the_keys_and_files():
    old = InputRecord({"phases.p.lr": 1e-3, "train.seed": 0}, {"index": "a", "models": "b"})
    new = InputRecord({"phases.p.lr": 2e-3, "train.seed": 0, "train.new": 1}, {"index": "a", "models": "c"})
    assert new.differences(old.to_json()) == ["phases.p.lr", "train.new", "file models (${paths.models})"]
    assert new.differences(new.to_json()) == []


def test_the_latent_digest_reads_the_shard_records_of_the_index_only(tmp_path):
    index = tmp_path / "mix.parquet"
    pq.write_table(pa.table({"source": ["a", "a"], "shard": [0, 0]}), index)
    folder = tmp_path / "latents/a/res"
    folder.mkdir(parents=True)

    def part(shard: int, encoder: str) -> None:
        table = pa.table({"x": [1]}).replace_schema_metadata({"encoder": encoder})
        pq.write_table(table, folder / part_name(shard))

    part(0, "vae-1")
    part(1, "vae-1")
    first = latent_shards_digest(index, tmp_path / "latents", "res")
    part(1, "vae-2")  # a shard the index does not use
    assert latent_shards_digest(index, tmp_path / "latents", "res") == first
    part(0, "vae-2")  # re-encoded with another VAE
    assert latent_shards_digest(index, tmp_path / "latents", "res") != first


def test_a_phase_record_hashes_every_declared_file(tmp_path):
    data = tiny_params(tmp_path)
    params = parse_params(data)
    record = phase_inputs(params, "phase1")
    assert set(record.files) == set(INPUT_FILES) - {"conditions"}  # a ControlNet phase's only: older records stay
    assert record.fingerprint == phase_inputs(params, "phase1").fingerprint  # the same on a second look
    data["conditions"] = {"kinds": ["canny"]}
    data["phases"]["phase2"]["controlnet"] = {"condition": "canny"}
    assert set(phase_inputs(parse_params(data), "phase2").files) == set(INPUT_FILES)
