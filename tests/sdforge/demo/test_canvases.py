"""Non-square demo images (issue 18): each corpus image on one of ``demo.canvases`` in turn, the shape sized
from the canvas's shorter side and fully inside it; ground-truth renders and the probe at any (width, height)."""

from __future__ import annotations

import json
import zipfile
from collections import Counter
from pathlib import Path

import cv2
import numpy as np
import polars as pl
import pytest

from sdforge.config import ConfigError, load_params, parse_params
from sdforge.demo.corpus import CanvasCycle, deck, draw
from sdforge.demo.shapes import ShapeSpec, parse_caption, probe, render, render_spec
from sdforge.eval.grid import probe_truth
from stages import make_demo_data

REPO_PARAMS = Path(__file__).resolve().parents[3] / "params.yaml"
CANVASES = [(48, 48), (48, 32), (32, 48)]


@pytest.fixture
def corpus(demo_params):
    """The tiny corpus (24 served rows, 10 archive images) on the shipped canvases."""
    make_demo_data.run(demo_params.demo, demo_params.paths.demo_source)
    return demo_params.demo, Path(demo_params.paths.demo_source)


def _served(root: Path, url: str) -> Path:
    return root / "http" / url.strip().split("/", 3)[3]


def _archive(root: Path) -> list[tuple[str, np.ndarray]]:
    with zipfile.ZipFile(root / "diffusiondb" / "part-000001.zip") as zf:
        mapping = json.loads(zf.read("part-000001.json"))
        return [
            (m["p"], cv2.imdecode(np.frombuffer(zf.read(n), np.uint8), cv2.IMREAD_COLOR)) for n, m in mapping.items()
        ]


def test_shipped_canvases():
    demo = load_params(REPO_PARAMS).demo
    assert demo.canvas_sizes == CANVASES
    cycle = CanvasCycle(demo)
    assert Counter(cycle.next() for _ in range(demo.laion_rows)) == {size: 168 for size in CANVASES}  # 504: thirds
    cycle = CanvasCycle(demo)
    assert Counter(cycle.next() for _ in range(demo.archive_images)) == {size: 72 for size in CANVASES}  # 216


def test_corpus_holds_each_canvas_and_rows_state_the_served_size(corpus):
    demo, root = corpus
    df = pl.read_parquet(root / "laion" / "part-00000.parquet")
    # rows drawn in turn: 24 served, 3 missing, 3 + 2 + 2 bad, 2 small (overridden to 16×16, drawn on 48×32 and
    # 32×48) = 36 → 12 per canvas; the 4 duplicates copy their original's size (seeded picks)
    assert Counter(zip(df["WIDTH"], df["HEIGHT"], strict=True)) == {
        (48, 48): 13, (48, 32): 12, (32, 48): 13, (16, 16): 2,
    }  # fmt: skip
    served = {}
    for url, width, height in df.select("URL", "WIDTH", "HEIGHT").iter_rows():
        path = _served(root, url)
        if path.is_file():
            img = cv2.imread(str(path))
            assert (img.shape[1], img.shape[0]) == (width, height), url
            served[path.name] = (width, height)
    assert len(served) == demo.laion_rows
    assert Counter(served.values()) == {size: 8 for size in CANVASES}  # 24 served images in turn
    archive = Counter((img.shape[1], img.shape[0]) for _, img in _archive(root))
    assert archive == {(48, 48): 4, (48, 32): 3, (32, 48): 3}  # 10 archive images in turn


def test_probe_reads_every_corpus_image(corpus):
    """The probe reads colour and shape back from every served and archive image, square or not (JPEG too)."""
    demo, root = corpus
    df = pl.read_parquet(root / "laion" / "part-00000.parquet")
    images = [
        (text, cv2.imread(str(_served(root, url))))
        for url, text in df.select("URL", "TEXT").iter_rows()
        if _served(root, url).is_file()
    ]
    images += _archive(root)
    assert len(images) == 26 + 10  # 24 served + 2 URL duplicates, 10 archive images
    for text, bgr in images:
        got = probe(cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB), demo.colours, demo.backgrounds)
        want = parse_caption(text)
        assert (got.colour, got.shape) == (want.colour, want.shape), text


@pytest.mark.parametrize("shape", ["circle", "square", "triangle"])
def test_shape_on_a_landscape_canvas_is_fully_inside(shape):
    demo = load_params(REPO_PARAMS).demo
    rng = np.random.default_rng(0)
    spec = ShapeSpec(shape=shape, colour="red", background="white")
    for _ in range(200):
        img = render(spec, (48, 32), demo.colours["red"], demo.backgrounds["white"], rng, demo.half_size)
        assert img.shape == (32, 48, 3)
        mask = np.abs(img.astype(int) - demo.backgrounds["white"]).sum(-1) > 0
        ys, xs = np.nonzero(mask)
        assert ys.min() >= 1 and ys.max() <= 30 and xs.min() >= 1 and xs.max() <= 46  # a background border
        # sized from the shorter side: half-width ⌊32 · [0.36, 0.40]⌋ = 11-12 px, 2·half + 1 wide (+2 px of
        # anti-aliasing); from the longer side (48) it would be 35 px or more
        side = xs.max() - xs.min() + 1
        assert 23 <= side <= 27, side


def test_default_canvas_is_the_square_image_size():
    """``canvases: []`` draws every image at ``image_size``² with the same random stream as before canvases."""
    demo = load_params(REPO_PARAMS).demo.model_copy(update={"canvases": []})
    assert demo.canvas_sizes == [(48, 48)]
    rng_a, rng_b = np.random.default_rng(5), np.random.default_rng(5)
    specs_a, specs_b = deck(demo, rng_a), deck(demo, rng_b)
    for _ in range(5):
        spec, img = draw(demo, specs_a, rng_a)
        assert np.array_equal(img, render_spec(demo, specs_b.draw(), rng_b)) and img.shape == (48, 48, 3)


def test_a_canvas_too_small_for_the_shapes_is_refused():
    data = json.loads(json.dumps(load_params(REPO_PARAMS).model_dump(mode="json")))
    data["demo"]["canvases"] = [[48, 48], [48, 16]]
    with pytest.raises(ConfigError, match="canvas 48x16"):
        parse_params(data)


@pytest.mark.parametrize("size", [(24, 40), (40, 24), (384, 640)])
def test_ground_truth_renders_at_any_width_and_height(size):
    params = load_params(REPO_PARAMS)
    img = render_spec(params.demo, parse_caption(params.eval.all_prompts[0]), np.random.default_rng(0), size)
    assert img.shape == (size[1], size[0], 3)


@pytest.mark.parametrize("size", [(24, 40), (40, 24)])
def test_probe_reads_non_square_ground_truth(size):
    params = load_params(REPO_PARAMS)
    truth = probe_truth(params.eval.all_prompts, params.demo, size)
    assert truth == {"probe_truth_images": 8 * 44, "probe_truth_colour": 1.0, "probe_truth_shape": 1.0}
