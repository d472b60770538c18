"""The README's picture (``tools.demo_figure``): phases as rows, the first prompts of each category as columns, each
cell the phase's own eval image of that prompt; a phase without images is an error naming its folder."""

from __future__ import annotations

import numpy as np
import yaml
from PIL import Image

from tests.fixtures.eval_workspace import REPO
from tools import demo_figure


def _params(tmp_path):
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["paths"]["eval"] = str(tmp_path / "eval")
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(params, sort_keys=False))
    return path, params


def _write_images(eval_dir, phase: str, count: int, value: int) -> None:
    """``count`` 8×8 images whose red channel is ``value`` and green channel the image's index."""
    folder = eval_dir / phase / "images"
    folder.mkdir(parents=True)
    for i in range(count):
        Image.fromarray(np.full((8, 8, 3), (value, i, 0), np.uint8)).save(folder / f"{i:02d}.png")


def test_each_cell_is_its_phases_image_of_its_prompt(tmp_path):
    path, params = _params(tmp_path)
    count = sum(len(prompts) for prompts in params["eval"]["prompts"].values())
    for row, phase in enumerate(("phase0", "phase7")):
        _write_images(tmp_path / "eval", phase, count, value=100 + row)
    out = tmp_path / "figure.png"
    assert demo_figure.main(["--params", str(path), "--phases", "phase0", "phase7", "--out", str(out)]) == 0
    # the first 2 distinct prompts of each category, at their index in eval.prompts (categories in file order)
    expected, start = [], 0
    for prompts in params["eval"]["prompts"].values():
        expected += [start + prompts.index(p) for p in list(dict.fromkeys(prompts))[:3]]
        start += len(prompts)
    figure = np.asarray(Image.open(out).convert("RGB"))
    cell = demo_figure.CELL + demo_figure.GAP
    assert figure.shape == (demo_figure.HEADER_H + 2 * cell, demo_figure.LABEL_W + len(expected) * cell, 3)
    for row, red in enumerate((100, 101)):
        for col, index in enumerate(expected):
            y, x = demo_figure.HEADER_H + row * cell + 10, demo_figure.LABEL_W + col * cell + 10
            assert tuple(figure[y, x]) == (red, index, 0), (row, col)


def test_a_phase_without_images_is_named(tmp_path, capsys):
    path, params = _params(tmp_path)
    out = tmp_path / "figure.png"
    assert demo_figure.main(["--params", str(path), "--phases", "phase0", "--out", str(out)]) == 2
    assert f"{tmp_path / 'eval' / 'phase0' / 'images'}: no image 00.png" in capsys.readouterr().err
    assert not out.exists()
