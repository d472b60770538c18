"""encode_latents: latents equal a direct VAE encode; bad samples counted; output independent of the
worker count; SIGKILL + rerun re-encodes only missing shards; disagreeing or stale shards are redone."""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import cv2
import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from diffusers import AutoencoderKL
from transformers import CLIPTokenizer

from model.latents import images_to_tensor
from sdforge.captions.store import SCHEMA
from sdforge.demo.models import write_demo_tokenizer
from sdforge.ingest.shards import tar_bytes
from sdforge.io import InputError
from sdforge.latents import store as store
from sdforge.latents.encoded import MANIFEST_SCHEMA
from stages import encode_latents
from tests.fixtures.demo_data import tree_digest
from tests.fixtures.encode_inputs import (
    BUCKETS,
    RES,
    SQ,
    TALL,
    WORDS,
    build_models,
    cfg,
    jpeg,
    mixed_tars,
    sample,
    write_tars,
)

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    return build_models(tmp_path_factory.mktemp("models"))


def digest(root: Path) -> str:
    return tree_digest(root)


def test_bf16_on_a_cpu_with_native_bf16_stays_close_to_fp32(models, tmp_path, monkeypatch):
    from model import precision

    write_tars(tmp_path / "shards", n_tars=1, per_tar=6)
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: True)
    m = encode_latents.run(cfg(mixed_precision="bf16"), "laion", tmp_path / "shards", models, tmp_path / "bf16")
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: False)
    m32 = encode_latents.run(cfg(mixed_precision="bf16"), "laion", tmp_path / "shards", models, tmp_path / "fp32")
    assert (m["precision"], m32["precision"]) == ("bf16", "fp32")
    assert_close_but_not_equal(tmp_path / "bf16", tmp_path / "fp32", 0.05)


def assert_close_but_not_equal(low_dir: Path, full_dir: Path, share: float) -> None:
    """The first shard's latents of ``low_dir`` (a reduced precision really ran: not equal) within ``share`` of
    ``full_dir``'s (fp32), relative and of its largest magnitude."""
    low, full = (torch.from_numpy(np.array(store.open_shard(d / store.shard_name(0, SQ)).latents)).float()
                 for d in (low_dir, full_dir))  # fmt: skip
    assert not torch.equal(low, full)
    torch.testing.assert_close(low, full, atol=share * float(full.abs().max()), rtol=share)


def test_fp16_stays_close_to_fp32_and_is_its_own_encoder(models, tmp_path):
    write_tars(tmp_path / "shards", n_tars=1, per_tar=6)
    m = encode_latents.run(cfg(mixed_precision="fp16"), "laion", tmp_path / "shards", models, tmp_path / "fp16")
    m32 = encode_latents.run(cfg(mixed_precision="no"), "laion", tmp_path / "shards", models, tmp_path / "fp32")
    assert (m["precision"], m32["precision"]) == ("fp16", "fp32")
    assert_close_but_not_equal(tmp_path / "fp16", tmp_path / "fp32", 0.01)
    again = encode_latents.run(cfg(mixed_precision="no"), "laion", tmp_path / "shards", models, tmp_path / "fp16")
    assert again["shards_encoded"] == 1  # another precision is another encoder: the shard is redone


def test_a_vae_that_overflows_fp16_is_refused_naming_the_key_and_the_fix(models, tmp_path):
    """A VAE whose first convolution's outputs pass fp16's 65504 (as SDXL's VAE's activations do): fp32 encodes
    finite latents, fp16 would store NaN — an InputError naming the samples, the key and the fp16-safe VAE."""
    hot = tmp_path / "models"
    shutil.copytree(models, hot)
    vae = AutoencoderKL.from_pretrained(hot / "vae")
    with torch.no_grad():
        vae.encoder.conv_in.weight.mul_(1e5)
    vae.save_pretrained(hot / "vae")
    write_tars(tmp_path / "shards", n_tars=1, per_tar=4)
    m = encode_latents.run(cfg(mixed_precision="no"), "laion", tmp_path / "shards", hot, tmp_path / "fp32")
    assert m["samples"] == 4
    with pytest.raises(InputError, match=r"4 of 4 samples.*mixed_precision fp16.*sdxl-vae-fp16-fix"):
        encode_latents.run(cfg(mixed_precision="fp16"), "laion", tmp_path / "shards", hot, tmp_path / "fp16")


def stamps(root: Path) -> dict[str, tuple[bytes, int]]:
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(root.iterdir())}


# --------------------------------------------------------------------------------- correctness


def test_latents_equal_a_direct_vae_encode(models, tmp_path):
    tars = write_tars(tmp_path / "shards", n_tars=2, per_tar=10)
    m = encode_latents.run(cfg(), "laion", tmp_path / "shards", models, tmp_path / "out")
    assert m["samples"] == 20 and m["shards"] == 2 and m["latent_shape"] == [4, RES // 2, RES // 2]
    vae = AutoencoderKL.from_pretrained(models / "vae").eval()
    tokenizer = CLIPTokenizer.from_pretrained(models / "tokenizer")
    manifest = pl.read_parquet(tmp_path / "out" / store.MANIFEST)
    assert manifest.columns == MANIFEST_SCHEMA.names
    for shard, tar_path in enumerate(tars):
        with tarfile.open(tar_path) as tar:
            files = {m.name: tar.extractfile(m).read() for m in tar if m.isfile()}
        keys = sorted({name.split(".")[0] for name in files})
        images = [
            cv2.cvtColor(cv2.imdecode(np.frombuffer(files[f"{k}.jpg"], np.uint8), 1), cv2.COLOR_BGR2RGB) for k in keys
        ]
        with torch.no_grad():
            direct = vae.encode(images_to_tensor(images)).latent_dist.mean * vae.config.scaling_factor
        arrays = store.open_shard(tmp_path / "out" / store.shard_name(shard, SQ))
        stored = torch.from_numpy(np.array(arrays.latents))
        assert stored.dtype == torch.float16
        torch.testing.assert_close(stored.float(), direct.half().float(), atol=1e-3, rtol=1e-3)
        rows = manifest.filter(pl.col("shard") == shard)
        assert rows["key"].to_list() == keys and rows["row"].to_list() == list(range(len(keys)))
        captions = [files[f"{k}.txt"].decode() for k in keys]
        assert rows["caption"].to_list() == captions
        expected_ids = tokenizer(captions, padding="max_length", max_length=77, truncation=True).input_ids
        assert np.array(arrays.input_ids).tolist() == expected_ids
        assert arrays.metadata["scaling_factor"] == "0.5" and arrays.metadata["samples"] == str(len(keys))
    assert manifest["original_width"].to_list() == [64] * 20 and manifest["width"].to_list() == [RES] * 20


def test_bad_samples_are_counted_never_a_crash(models, tmp_path):
    rng = np.random.default_rng(1)
    long_caption = " ".join(["a red circle on a white background"] * 20)  # 120 words > 77 tokens
    samples = [
        sample("k0", rng),
        sample("k1", rng, jpg=None),  # no image
        sample("k2", rng, jpg=b"\xff\xd8 not a jpeg"),  # does not decode
        sample("k3", rng, jpg=jpeg(rng, 24, 20)),  # wrong size: resized + centre-cropped
        sample("k4", rng, txt=""),  # empty caption: kept
        sample("k5", rng, txt=long_caption),  # truncated: kept
        sample("k6", rng, json=b"{not json"),  # unreadable metadata: kept
    ]
    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "00000.tar").write_bytes(tar_bytes(samples))
    damaged = tar_bytes([sample(f"d{i}", rng) for i in range(4)])
    (shards / "00001.tar").write_bytes(damaged[: len(damaged) // 2])  # cut inside a member
    m = encode_latents.run(cfg(), "laion", shards, models, tmp_path / "out")
    assert m["skipped_no_image"] == 1 and m["skipped_corrupt"] == 1 and m["tar_errors"] == 1
    assert m["resized"] == 1 and m["captions_empty"] == 1 and m["captions_truncated"] == 1
    manifest = pl.read_parquet(tmp_path / "out" / store.MANIFEST)
    assert manifest.height == m["samples"] and manifest.filter(pl.col("shard") == 0).height == 5
    k3 = manifest.filter(pl.col("key") == "k3").row(0, named=True)
    assert (k3["width"], k3["height"], k3["resized"]) == (20, 24, True)
    assert store.open_shard(tmp_path / "out" / store.shard_name(0, SQ)).latents.shape == (5, 4, RES // 2, RES // 2)

    skip = encode_latents.run(cfg(wrong_size="skip"), "laion", shards, models, tmp_path / "skip")
    assert skip["skipped_wrong_size"] == 1 and skip["resized"] == 0 and skip["samples"] == m["samples"] - 1


def test_output_is_independent_of_workers_prefetch_and_mtimes(models, tmp_path):
    tars = write_tars(tmp_path / "shards", n_tars=3, per_tar=11)
    one = encode_latents.run(
        cfg(decode_workers=1, prefetch_shards=0), "laion", tmp_path / "shards", models, tmp_path / "a"
    )
    for i, tar in enumerate(tars):
        os.utime(tar, ns=(10**18 + i, 10**18 + i))  # as after a dvc checkout: same bytes, new mtimes
    three = encode_latents.run(
        cfg(decode_workers=3, prefetch_shards=2), "laion", tmp_path / "shards", models, tmp_path / "b"
    )
    assert one["samples"] == three["samples"] == 33
    assert digest(tmp_path / "a") == digest(tmp_path / "b")


@pytest.mark.parametrize("fmt", [tarfile.GNU_FORMAT, tarfile.PAX_FORMAT, tarfile.USTAR_FORMAT])
def test_tar_reader_matches_tarfile(fmt, tmp_path):
    from collections import Counter

    from sdforge.latents.inputs import iter_tar_groups, iter_tar_members

    long_dir = "d" * 120 if fmt != tarfile.USTAR_FORMAT else "d" * 60 + "/" + "e" * 60
    members = {"a/0001.jpg": b"x" * 700, "a/0001.txt": b"caption", f"{long_dir}/0002.jpg": b"y" * 512, "0003.json": b""}
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
        dir_info = tarfile.TarInfo("a")
        dir_info.type = tarfile.DIRTYPE
        tar.addfile(dir_info)
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    assert dict(iter_tar_members(io.BytesIO(buf.getvalue()))) == members
    groups = dict(iter_tar_groups(io.BytesIO(buf.getvalue()), Counter()))
    assert groups["a/0001"] == {"jpg": b"x" * 700, "txt": b"caption"} and groups["0003"] == {"json": b""}


def test_token_ids_equal_the_tokenizer_with_truncation(models):
    from sdforge.latents.inputs import Tokens

    tokenizer = CLIPTokenizer.from_pretrained(models / "tokenizer")
    captions = ["a red circle", "", " ".join(["a blue square on a black background"] * 12), "a red circle"]
    ids, truncated = Tokens(tokenizer)(captions)
    expected = tokenizer(captions, padding="max_length", max_length=77, truncation=True).input_ids
    assert ids.dtype == torch.int32 and ids.tolist() == expected and truncated == [False, False, True, False]


# -------------------------------------------------------------------------------------- resume


@pytest.fixture(scope="module")
def encoded(models, tmp_path_factory) -> tuple[Path, str]:
    """Six input tars (``<root>/shards/laion``), their uninterrupted encoding in ``<root>/out`` and its digest."""
    root = tmp_path_factory.mktemp("encoded")
    write_tars(root / "shards" / "laion", n_tars=6, per_tar=24, seed=2)
    encode_latents.run(cfg(), "laion", root / "shards" / "laion", models, root / "out")
    return root / "shards" / "laion", digest(root / "out")


def _workspace(root: Path, models: Path, shards: Path) -> Path:
    data = yaml.safe_load((REPO / "params.yaml").read_text())
    data["paths"] = {k: str(root / k) for k in data["paths"]}
    data["paths"].update(models=str(models), shards=str(shards.parent))
    data["tracking"]["mlflow_uri"] = f"sqlite:///{root / 'mlflow.db'}"
    data["encode"] = cfg().model_dump()
    data.pop("buckets")  # the implicit square-only set "square" of encode.resolution
    for phase in data["phases"].values():
        phase.pop("resolution", None)
    path = root / "params.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _cli(params: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "SDFORGE_LOG_LEVEL": "WARNING"}
    env.pop("MLFLOW_TRACKING_URI", None)
    cmd = [sys.executable, "-m", "stages.encode_latents", "--params", str(params), "--item", "laion"]
    return subprocess.Popen(cmd, cwd=params.parent, env=env, start_new_session=True)


def _complete(out: Path) -> set[int]:
    done = set()
    for part in out.glob(store.PART_PATTERN):
        shard = int(part.name.split(".")[0].removeprefix("shard-"))
        try:
            store.check_shard(out, shard)
            done.add(shard)
        except ValueError:
            pass
    return done


def test_sigkill_then_rerun_encodes_only_the_missing_shards(models, encoded, tmp_path, monkeypatch):
    shards, reference = encoded  # the same input files (same mtimes) as the reference run's
    params = _workspace(tmp_path, models, shards)
    out = tmp_path / "latents" / "laion" / "square"  # the implicit square-only bucket set
    proc = _cli(params)
    deadline = time.monotonic() + 120
    while proc.poll() is None and not list(out.glob(store.PART_PATTERN)) and time.monotonic() < deadline:
        time.sleep(0.005)  # poll for the first completed shard, then kill the whole process group
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL, "the stage finished before it could be killed"
    done = _complete(out)
    assert 1 <= len(done) < 6, done
    before = {name: v for name, v in stamps(out).items() if name.startswith("shard-")}
    assert not (out / store.MANIFEST).exists()

    monkeypatch.chdir(tmp_path)  # the rerun: the same CLI, in this process (MLflow logging stubbed out)
    monkeypatch.setattr(encode_latents, "log_stage", lambda *a, **k: None)
    encode_latents.main(["--params", str(params), "--item", "laion"])
    metrics = json.loads((tmp_path / "metrics/encode_latents/laion.json").read_text())
    assert metrics["shards_reused"] == len(done) and metrics["shards_encoded"] == 6 - len(done)
    after = stamps(out)
    for shard in done:
        for name in (store.shard_name(shard, SQ), store.part_name(shard)):
            assert after[name] == before[name], f"{name} was rewritten"
    assert digest(out) == reference  # every shard, part and the manifest: as an uninterrupted run


def test_disagreeing_shards_are_detected_and_redone(models, encoded, tmp_path):
    shards, reference = encoded
    out = tmp_path / "out"
    shutil.copytree(shards.parents[1] / "out", out)
    sf1 = out / store.shard_name(1, SQ)
    sf1.write_bytes(sf1.read_bytes()[:-100])  # truncated array
    table, meta = store.read_part(out / store.part_name(2))
    store.write_part(out / store.part_name(2), table.slice(0, table.num_rows - 3), meta)  # rows deleted
    (out / store.part_name(3)).unlink()  # killed between the safetensors and its part
    other = store.open_shard(out / store.shard_name(5, SQ)).metadata
    sf4 = out / store.shard_name(4, SQ)
    arrays = store.open_shard(sf4)
    store.write_shard(
        sf4, torch.from_numpy(np.array(arrays.latents)), torch.from_numpy(np.array(arrays.input_ids)), other
    )
    (out / ".shard-00000.safetensors.abc.tmp").write_bytes(b"left by a kill")
    (out / store.shard_name(9, SQ)).write_bytes(b"no input tar 00009.tar")
    before = stamps(out)
    for shard, why in [(1, "truncated"), (2, "rows but its metadata"), (3, "manifest part missing"), (4, "disagrees")]:
        with pytest.raises(ValueError, match=why):
            store.check_shard(out, shard)

    m = encode_latents.run(cfg(), "laion", shards, models, out)
    assert (m["shards_reused"], m["shards_encoded"]) == (2, 4)
    after = stamps(out)
    assert all(after[store.shard_name(s, SQ)] == before[store.shard_name(s, SQ)] for s in (0, 5))
    assert digest(out) == reference


def test_changed_inputs_or_encoder_are_redone(models, encoded, tmp_path):
    inputs, reference = encoded
    shards, out = tmp_path / "shards", tmp_path / "out"
    shutil.copytree(inputs, shards)
    shutil.copytree(inputs.parents[1] / "out", out)
    os.utime(shards / "00000.tar", ns=(1, 1))  # new mtime, same bytes (e.g. a dvc checkout): kept
    rng = np.random.default_rng(9)
    (shards / "00001.tar").write_bytes(tar_bytes(sample(f"x{i}", rng) for i in range(5)))  # new content
    (shards / "00005.tar").unlink()  # input gone: its shard is removed
    m = encode_latents.run(cfg(), "laion", shards, models, out)
    assert (m["shards"], m["shards_reused"], m["shards_encoded"], m["samples"]) == (5, 4, 1, 4 * 24 + 5)
    assert not (out / store.shard_name(5, SQ)).exists() and not (out / store.part_name(5)).exists()

    models2 = tmp_path / "models"
    shutil.copytree(models, models2)
    config = json.loads((models2 / "vae/config.json").read_text())
    (models2 / "vae/config.json").write_text(json.dumps({**config, "scaling_factor": 1.0}))
    m2 = encode_latents.run(cfg(), "laion", shards, models2, out)
    assert m2["shards_reused"] == 0 and m2["shards_encoded"] == 5  # another VAE: nothing stale is reused
    again = encode_latents.run(cfg(), "laion", inputs, models, tmp_path / "fresh")
    assert again["shards_encoded"] == 6 and digest(tmp_path / "fresh") == reference


def test_s3_input_equals_local_input(models, encoded, tmp_path, monkeypatch):
    moto = pytest.importorskip("moto")
    import boto3

    from sdforge.latents import s3_inputs

    shards, _ = encoded
    root = shards.parents[1]
    for key, value in {
        "AWS_ACCESS_KEY_ID": "x",
        "AWS_SECRET_ACCESS_KEY": "x",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    s3_inputs._client.cache_clear()
    try:
        with moto.mock_aws():
            s3 = boto3.client("s3")
            s3.create_bucket(Bucket="bkt")
            for tar in sorted(shards.glob("*.tar")):
                s3.upload_file(str(tar), "bkt", f"shards/laion/{tar.name}")
            m = encode_latents.run(cfg(prefetch_shards=2), "laion", "s3://bkt/shards/laion", models, tmp_path / "out")
    finally:
        s3_inputs._client.cache_clear()
    assert m["shards"] == 6 and m["shards_encoded"] == 6
    assert (tmp_path / "out" / store.MANIFEST).read_bytes() == (root / "out" / store.MANIFEST).read_bytes()
    for shard in range(6):
        a = store.open_shard(tmp_path / "out" / store.shard_name(shard, SQ))
        b = store.open_shard(root / "out" / store.shard_name(shard, SQ))
        assert np.array_equal(a.latents, b.latents) and np.array_equal(a.input_ids, b.input_ids)
        assert a.metadata["input_sha256"] == b.metadata["input_sha256"]


def test_no_tars_is_an_input_error(models, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no .tar shards"):
        encode_latents.run(cfg(), "laion", tmp_path / "empty", models, tmp_path / "out")


def test_a_failing_vae_setup_stops_the_input_threads(tmp_path):
    """The encoder is built after the reader/batcher/decode threads start: if that fails, they stop."""
    import threading

    from sdforge.latents.inputs import TarInput
    from sdforge.latents.pipeline import Options, encode_shards

    paths = write_tars(tmp_path / "shards", n_tars=2, per_tar=20)
    tars = [TarInput(i, p.name, str(p), p.stat().st_size) for i, p in enumerate(paths)]

    class BrokenVae:
        def to(self, device):
            raise RuntimeError("no such device: cuda:7")

    before = set(threading.enumerate())
    tokenizer = CLIPTokenizer.from_pretrained(tokenizer_only_models(tmp_path) / "tokenizer")
    with pytest.raises(RuntimeError, match="cuda:7"):
        list(encode_shards(tars, BrokenVae(), tokenizer, Options(batch_size=4, buckets=(SQ,), decode_workers=2)))
    left = [t.name for t in set(threading.enumerate()) - before if t.is_alive()]
    assert left == []


def tokenizer_only_models(tmp_path: Path) -> Path:
    root = tmp_path / "models"
    write_demo_tokenizer(WORDS, root / "tokenizer", 77)
    return root


# ------------------------------------------------------------------------------------------ buckets

def test_each_bucket_gets_shards_of_one_shape_and_the_manifest_records_the_crop(models, tmp_path):
    from sdforge.ingest.buckets import plan
    from sdforge.latents.inputs import cover_crop

    mixed_tars(tmp_path / "shards")
    m = encode_latents.run(cfg(), "laion", tmp_path / "shards", models, tmp_path / "out", BUCKETS)
    assert m["buckets"] == {"16x24": 2, "16x16": 6, "24x16": 4} and m["samples"] == 12
    files = sorted(p.name for p in (tmp_path / "out").glob("*.safetensors"))
    assert files == [
        "shard-00000-16x16.safetensors",
        "shard-00001-16x16.safetensors",
        "shard-00001-16x24.safetensors",
        "shard-00001-24x16.safetensors",
    ]
    for name, (n, shape) in {"00001-24x16": (4, (4, 8, 12)), "00001-16x24": (2, (4, 12, 8))}.items():
        assert store.open_shard(tmp_path / "out" / f"shard-{name}.safetensors").latents.shape == (n, *shape)
    manifest = pl.read_parquet(tmp_path / "out" / store.MANIFEST)
    for row in manifest.iter_rows(named=True):
        p = plan(row["width"], row["height"], BUCKETS)
        assert (row["bucket_width"], row["bucket_height"]) == p.bucket
        assert (row["resized_width"], row["resized_height"]) == p.resized
        assert (row["crop_left"], row["crop_top"], row["crop_right"], row["crop_bottom"]) == p.box
    wide = manifest.filter(pl.col("key") == "1004").row(0, named=True)  # 36×20 → 24×16: resized 29×16, 2 px cut left
    assert (wide["resized_width"], wide["crop_left"], wide["crop_right"]) == (29, 2, 26)
    # the latents of a landscape sample are the VAE's encoding of its cover-and-crop image
    from sdforge.latents.inputs import decode_sample

    tar1 = (tmp_path / "shards" / "00001.tar").read_bytes()
    with tarfile.open(fileobj=io.BytesIO(tar1)) as tf:
        jpg = tf.extractfile("1004.jpg").read()
    img = decode_sample("1004", {"jpg": jpg}, BUCKETS).image
    raw = cv2.imdecode(np.frombuffer(jpg, np.uint8), cv2.IMREAD_COLOR)[:, :, ::-1]
    assert np.array_equal(img, cover_crop(np.ascontiguousarray(raw), plan(36, 20, BUCKETS)))


def test_a_bucket_set_change_re_encodes_only_the_tars_it_moves_a_sample_of(models, tmp_path):
    mixed_tars(tmp_path / "shards")
    out = tmp_path / "out"
    encode_latents.run(cfg(), "laion", tmp_path / "shards", models, out, BUCKETS)
    before = stamps(out)
    again = encode_latents.run(cfg(), "laion", tmp_path / "shards", models, out, BUCKETS)
    assert (again["shards_reused"], again["shards_encoded"]) == (2, 0)
    wider = [TALL, SQ, (32, 16)]  # the landscape bucket changes: tar 1 moves, tar 0 (square only) does not
    m = encode_latents.run(cfg(), "laion", tmp_path / "shards", models, out, wider)
    assert (m["shards_reused"], m["shards_encoded"]) == (1, 1) and m["buckets"] == {"16x24": 2, "16x16": 6, "32x16": 4}
    after = stamps(out)
    assert after["shard-00000-16x16.safetensors"] == before["shard-00000-16x16.safetensors"]
    assert after["shard-00000.parquet"] == before["shard-00000.parquet"]
    assert "shard-00001-24x16.safetensors" not in after and "shard-00001-32x16.safetensors" in after
    fresh = encode_latents.run(cfg(), "laion", tmp_path / "shards", models, tmp_path / "fresh", wider)
    assert fresh["samples"] == m["samples"] and digest(out) == digest(tmp_path / "fresh")


def test_run_resolutions_keeps_one_folder_per_bucket_set(models, tmp_path, monkeypatch):
    from sdforge.config import parse_params
    from tests.fixtures.training import tiny_params

    mixed_tars(tmp_path / "shards" / "laion")
    data = tiny_params(tmp_path)
    data["paths"].update(shards=str(tmp_path / "shards"), models=str(models), latents=str(tmp_path / "latents"))
    data["buckets"] = {"lo": {"sizes": [[8, 8]], "step": 8}, "hi": {"sizes": [list(b) for b in BUCKETS], "step": 8}}
    data["encode"] = {**cfg().model_dump(), "resolutions": ["lo", "hi"]}
    data["phases"]["phase1"]["resolution"] = data["phases"]["phase2"]["resolution"] = "hi"
    m = encode_latents.run_resolutions(parse_params(data), "laion")
    assert m["lo.samples"] == m["hi.samples"] == 12 and m["lo.buckets"] == {"8x8": 12}
    assert m["shards_encoded"] == 4 and m["resolution"] == "lo"
    assert m["images_encoded"] == 12 and m["images_per_second"] > 0  # source images, each encoded once per set
    assert m["images_per_second"] < min(m["lo.images_per_second"], m["hi.images_per_second"])
    assert sorted(p.name for p in (tmp_path / "latents" / "laion").iterdir()) == ["hi", "lo"]
    assert store.open_shard(tmp_path / "latents/laion/lo/shard-00001-8x8.safetensors").latents.shape == (7, 4, 4, 4)


# -------------------------------------------------------------------------------------- synthetic captions


def _write_captions(folder: Path, tar: Path, text: dict[str, str]) -> None:
    """A caption_images parquet for ``tar``: ``text`` maps keys to synthetic captions (others: none)."""
    rows = [{name: None for name in SCHEMA.names} | {"key": k, "synthetic_caption": v} for k, v in text.items()]
    folder.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=SCHEMA), folder / f"{tar.stem}.parquet")


def test_synthetic_captions_are_tokenized_beside_the_originals_and_their_change_redoes_only_that_shard(
    models, tmp_path
):
    tars = write_tars(tmp_path / "shards", n_tars=2, per_tar=6, seed=5)
    captions, out = tmp_path / "captions", tmp_path / "out"
    keys = [f"00000{i:04d}" for i in range(6)]
    _write_captions(captions, tars[0], {k: "a black square" for k in keys[:4]})  # 2 samples without one
    metrics = encode_latents.run(cfg(), "web", tmp_path / "shards", models, out, captions_dir=captions)
    assert metrics["captions_synthetic"] == 4
    tokenizer = CLIPTokenizer.from_pretrained(models / "tokenizer")
    with_ = store.open_shard(out / store.shard_name(0, SQ))
    without = store.open_shard(out / store.shard_name(1, SQ))
    assert without.synthetic_ids is None  # no captions for tar 1: originals only
    manifest = pl.read_parquet(out / store.MANIFEST).filter(pl.col("shard") == 0).sort("row")
    for row, key, original, synthetic in manifest.select("row", "key", "caption", "synthetic_caption").iter_rows():
        expected = "a black square" if key in keys[:4] else original
        assert synthetic == ("a black square" if key in keys[:4] else None)
        ids = tokenizer(expected, padding="max_length", max_length=77, truncation=True).input_ids
        assert with_.synthetic_ids[row].tolist() == ids
        assert with_.input_ids[row].tolist() == tokenizer(original, padding="max_length", max_length=77).input_ids
    _write_captions(captions, tars[0], {k: "a red circle" for k in keys[:4]})
    again = encode_latents.run(cfg(), "web", tmp_path / "shards", models, out, captions_dir=captions)
    assert (again["shards_encoded"], again["shards_reused"]) == (1, 1)
