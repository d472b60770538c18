"""The ``make demo-recaption`` source: images captioned with file names only, their truth beside them, never a
held-out combination; and the tool's scoring of synthetic captions against that truth."""

from __future__ import annotations

import json
from pathlib import Path

import cv2
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from sdforge.captions.store import SCHEMA
from sdforge.config import parse_params
from sdforge.demo.corpus import WEBDUMP_DIR, WEBDUMP_TRUTH, webdump_images
from sdforge.demo.shapes import parse_caption
from tools.demo_recaption import score
from tools.tiny_demo import RECAPTION_OVERLAY, merged

REPO = Path(__file__).resolve().parents[3]


def _params(root: Path, images: int = 30) -> dict:
    data = merged(yaml.safe_load((REPO / "params.yaml").read_text()), yaml.safe_load(RECAPTION_OVERLAY.read_text()))
    data["demo"]["webdump"]["images"] = images
    data["paths"] = {k: str(root / v) for k, v in data["paths"].items()}
    return data


def test_webdump_images_carry_only_file_names_and_their_truth(tmp_path):
    params = parse_params(_params(tmp_path))
    folder = tmp_path / WEBDUMP_DIR
    assert webdump_images(params.demo, np.random.default_rng(0), folder) == 30
    truth = json.loads((folder / WEBDUMP_TRUTH).read_text())
    names = [(folder / f"{i:05d}.txt").read_text() for i in range(30)]
    assert names == [f"DSC_{1000 + i:05d}.JPG" for i in range(30)] and list(truth) == names
    held = {tuple(h) for h in params.demo.held_out}
    for caption in truth.values():
        spec = parse_caption(caption)
        assert (spec.colour, spec.shape, spec.background) not in held and spec.colour in params.demo.colours
    sizes = {cv2.imread(str(folder / f"{i:05d}.png")).shape[:2] for i in range(30)}
    assert sizes == {(h, w) for w, h in params.demo.canvas_sizes}  # the demo's canvases in turn


def test_the_tool_scores_each_word_of_the_synthetic_captions(tmp_path):
    data = _params(tmp_path)
    folder = tmp_path / data["paths"]["demo_source"] / WEBDUMP_DIR
    folder.mkdir(parents=True)
    truth = {
        "DSC_01000.JPG": "a red circle on a white background",
        "DSC_01001.JPG": "a blue square on a black background",
    }
    (folder / WEBDUMP_TRUTH).write_text(json.dumps(truth))
    rows = [
        {
            "original_caption": "DSC_01000.JPG",
            "synthetic_caption": "a red square on a white background",
            "rejected": None,
        },
        {"original_caption": "DSC_01001.JPG", "synthetic_caption": "DSC_01001.JPG", "rejected": "repetition"},
    ]
    out = tmp_path / data["paths"]["captions"] / "webdump"
    out.mkdir(parents=True)
    table = pa.Table.from_pylist([{n: None for n in SCHEMA.names} | r for r in rows], schema=SCHEMA)
    pq.write_table(table, out / "00000.parquet")
    got = score(tmp_path, data)
    assert (got["images"], got["colour_right"], got["shape_right"], got["background_right"]) == (2, 0.5, 0.0, 0.5)
    assert got["kept_original"] == 1
