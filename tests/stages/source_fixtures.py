"""Small fixtures in each local source's real on-disk format, and helpers the source tests share.

* JourneyDB: ``data/train/imgs/NNN.tgz`` (members ``NNN/<hash>.jpg``) and
  ``data/train/train_anno_realease_repath.jsonl.tgz`` (one ``.jsonl``, ``img_path`` ``./NNN/<hash>.jpg``).
* VGGFace2: ``train/<identity>/<nnnn_nn>.jpg`` and ``meta/identity_meta.csv`` (a space after each comma).
* COCO 2017: ``annotations/{instances,captions}_train2017.json`` and ``train2017/<file_name>``.
* Local folder: images with ``.txt`` or ``.json`` side files.
"""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from PIL import Image

from stages import download_metadata, fetch_images, filter_metadata, shards
from stages.config import Source

REPO = Path(__file__).resolve().parents[2]
RED, GREEN, BLUE = (220, 30, 30), (30, 170, 40), (30, 60, 220)


def image_bytes(w: int, h: int, rgb: tuple[int, ...] = RED, fmt: str = "JPEG", mode: str = "RGB") -> bytes:
    """A solid-colour image file's bytes."""
    buf = io.BytesIO()
    Image.new(mode, (w, h), rgb).save(buf, fmt, **({"quality": 95} if fmt == "JPEG" else {}))
    return buf.getvalue()


def decode(jpeg: bytes) -> np.ndarray:
    """A sample's JPEG as an RGB array."""
    assert jpeg[:2] == b"\xff\xd8", "not a JPEG"
    return np.asarray(Image.open(io.BytesIO(jpeg)).convert("RGB"))


def centre_colour(jpeg: bytes) -> tuple[int, ...]:
    img = decode(jpeg)
    return tuple(int(v) for v in img[img.shape[0] // 2, img.shape[1] // 2])


def close_to(colour: tuple[int, ...], expected: tuple[int, ...], tol: int = 6) -> bool:
    return all(abs(a - b) <= tol for a, b in zip(colour, expected, strict=True))


def add_member(
    tar: tarfile.TarFile, name: str, data: bytes = b"", kind: bytes = tarfile.REGTYPE, link: str = ""
) -> None:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.size, info.mtime = kind, link, len(data) if kind == tarfile.REGTYPE else 0, 0
    tar.addfile(info, io.BytesIO(data) if kind == tarfile.REGTYPE else None)


# ---------------------------------------------------------------- JourneyDB


def journeydb_record(img_path: str, prompt: Any, caption: Any = "a description") -> dict[str, Any]:
    """One annotation line, shaped like ``train_anno_realease_repath.jsonl``."""
    return {
        "img_path": img_path,
        "url": "https://cdn.midjourney.com/x/grid_0.png",
        "prompt": prompt,
        "Task1": {"Style": ["photo"], "Content": ["cat"]},
        "Task2": {"Caption": caption},
        "Task3": {"Questions": ["?"], "Options": [["a"]], "Answers": ["a"]},
    }


def write_journeydb(root: Path, archives: dict[str, dict[str, bytes]], lines: list[dict | str]) -> None:
    """``archives``: stem → {file name: bytes} (stored as ``<stem>/<file name>``); ``lines``: records
    (dicts) or raw text lines of the annotation JSONL."""
    imgs = root / "data" / "train" / "imgs"
    imgs.mkdir(parents=True, exist_ok=True)
    for stem, files in archives.items():
        with tarfile.open(imgs / f"{stem}.tgz", "w:gz") as tar:
            for name, data in files.items():
                add_member(tar, f"{stem}/{name}", data)
    text = "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines).encode()
    with tarfile.open(root / "data" / "train" / "train_anno_realease_repath.jsonl.tgz", "w:gz") as tar:
        add_member(tar, "train_anno_realease_repath.jsonl", text)


# ---------------------------------------------------------------- VGGFace2


def write_vggface2(root: Path, images: dict[str, bytes], identities: list[tuple[str, str, str]]) -> None:
    """``images``: path under ``train/`` → bytes; ``identities``: ``(Class_ID, Name, Gender)`` rows."""
    for rel, data in images.items():
        (root / "train" / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / "train" / rel).write_bytes(data)
    meta = root / "meta" / "identity_meta.csv"
    meta.parent.mkdir(parents=True, exist_ok=True)
    lines = ["Class_ID, Name, Sample_Num, Flag, Gender"]
    lines += [f'{cid}, "{name}", 1, 1, {gender}' for cid, name, gender in identities]
    meta.write_text("\n".join(lines) + "\n")


# ---------------------------------------------------------------- COCO


def write_coco(
    root: Path,
    images: list[dict[str, Any]],
    boxes: list[tuple[int, list[float], int]],
    captions: list[tuple[int, int, Any]],
    files: dict[str, bytes],
) -> None:
    """``images``: COCO image entries; ``boxes``: ``(image_id, bbox, iscrowd)`` person boxes;
    ``captions``: ``(annotation id, image_id, caption)``; ``files``: relative path → bytes."""
    categories = [
        {"supercategory": "person", "id": 1, "name": "person"},
        {"supercategory": "animal", "id": 18, "name": "dog"},
    ]
    annotations = [
        {"id": 1000 + i, "image_id": image_id, "category_id": 1, "bbox": bbox, "iscrowd": crowd, "area": 1.0}
        for i, (image_id, bbox, crowd) in enumerate(boxes)
    ]
    # a tall dog never qualifies an image
    annotations.append(
        {"id": 999, "image_id": images[0]["id"], "category_id": 18, "bbox": [0, 0, 9, 9999], "iscrowd": 0}
    )
    info = {"description": "COCO 2017 Dataset", "version": "1.0"}
    instances = {"info": info, "images": images, "annotations": annotations, "categories": categories}
    caption_anns = [{"id": cid, "image_id": image_id, "caption": text} for cid, image_id, text in captions]
    (root / "annotations").mkdir(parents=True, exist_ok=True)
    (root / "annotations" / "instances_train2017.json").write_text(json.dumps(instances))
    (root / "annotations" / "captions_train2017.json").write_text(
        json.dumps({"info": info, "images": images, "annotations": caption_anns})
    )
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)


def coco_image(image_id: int, w: int, h: int, file_name: str | None = None) -> dict[str, Any]:
    return {"id": image_id, "width": w, "height": h, "file_name": file_name or f"{image_id:012d}.jpg", "license": 1}


# ---------------------------------------------------------------- local folder


def write_files(root: Path, files: dict[str, bytes | str]) -> None:
    for rel, data in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data.encode() if isinstance(data, str) else data)


# ---------------------------------------------------------------- running the stages


def full_source(name: str, repo: Path, **changes: Any) -> Source:
    """``configs/full/params.yaml``'s source ``name`` read from ``repo``, fetch at 32 px, small shards, one process
    and ``changes`` (option sections merged)."""
    data = yaml.safe_load((REPO / "configs" / "full" / "params.yaml").read_text())["sources"][name]
    data["repo"] = str(repo)
    data["fetch"] = {**data.get("fetch", {}), "image_size": 32, "shard_size": 4, "processes": 1}
    for key, value in changes.items():
        data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) else value
    return Source.model_validate(data)


def run_source(source: Source, name: str, work: Path) -> tuple[dict, dict, Path]:
    """download → filter → fetch into ``work``; return ``(filter metrics, fetch metrics, shard folder)``."""
    meta, filtered, out = work / "metadata", work / "filtered", work / "shards"
    download_metadata.run(source, meta)
    filter_metrics = filter_metadata.run(source, name, meta, filtered)
    fetch_metrics = fetch_images.run(source, name, filtered, meta, out)
    return filter_metrics, fetch_metrics, out


def samples_by_member(out: Path) -> dict[str, dict[str, Any]]:
    """``{member: {"json": dict, "txt": str, "jpg": bytes, "key": str}}`` over every shard of ``out``."""
    found = {}
    for key, sample in shards.iter_samples(out):
        meta = json.loads(sample["json"])
        found[meta["member"]] = {"json": meta, "txt": sample["txt"].decode(), "jpg": sample["jpg"], "key": key}
    return found


def statuses(out: Path) -> dict[str, str]:
    """``{member: status}`` over every shard parquet of ``out``."""
    import polars as pl

    return {
        m: s
        for path in sorted(out.glob("*.parquet"))
        for m, s in pl.read_parquet(path).select("member", "status").iter_rows()
    }


def status_totals(out: Path) -> dict[str, int]:
    """The shards' ``status_dict`` summed."""
    totals: dict[str, int] = {}
    for path in sorted(out.glob("*_stats.json")):
        for status, n in json.loads(path.read_text())["status_dict"].items():
            totals[status] = totals.get(status, 0) + n
    return totals


def check_tar_layout(folder: Path) -> None:
    """Every tar's members are sorted, have a fixed mtime and come as jpg/json/txt triples."""
    for tar_path in sorted(folder.glob("*.tar")):
        with tarfile.open(tar_path) as tar:
            members = tar.getmembers()
        names = [m.name for m in members]
        assert names == sorted(names)
        assert {m.mtime for m in members} <= {0}
        assert [n.split(".", 1)[1] for n in names] == ["jpg", "json", "txt"] * (len(names) // 3)
