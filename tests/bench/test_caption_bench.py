"""bench.caption (issue 26): a small run prints its RESULT line with both rates; both paths caption every image.

Values only; no timing is asserted."""

from __future__ import annotations

import re

from bench import caption


def test_a_small_run_prints_both_rates_and_a_ratio(capsys):
    caption.main(["--images", "24", "--per-tar", "8", "--batch", "8", "--width", "32", "--layers", "1",
                  "--size", "32", "--rounds", "1"])  # fmt: skip
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("RESULT name=caption ratio=")
    fields = dict(re.findall(r"(\w+)=(\"[^\"]*\"|\S+)", last))
    assert int(fields["images"]) == 24 and int(fields["batch"]) == 8
    assert float(fields["ours_img_s"]) > 0 and float(fields["baseline_img_s"]) > 0
    assert float(fields["ratio"]) == float(fields["ratio_min"]) == float(fields["ratio_max"])  # one round


def test_the_fixture_tars_hold_every_image_with_its_file_name_caption(tmp_path):
    caption.make_tars(tmp_path, 10, 4, 16)
    assert sorted(p.name for p in tmp_path.glob("*.tar")) == ["00000.tar", "00001.tar", "00002.tar"]
    images = caption.decoded(tmp_path)
    assert len(images) == 10 and images[0].shape == (16, 16, 3)
