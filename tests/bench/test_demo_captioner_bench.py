"""bench.demo_captioner (issue 26): a tiny run prints its RESULT line; the ratio is ours over chance, the file-name
captions score 0. Values only; no timing or accuracy bar is asserted here (tests/sdforge/demo does that)."""

from __future__ import annotations

import re

from bench import demo_captioner


def test_a_tiny_run_prints_accuracies_against_chance_and_file_names(capsys):
    demo_captioner.main(["--seeds", "0", "--steps", "10", "--eval-images", "30", "--width", "32", "--layers", "1"])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("RESULT name=demo_captioner ratio=")
    fields = dict(re.findall(r"(\w+)=(\"[^\"]*\"|\S+)", last))
    assert float(fields["file_name_acc"]) == 0.0 and int(fields["seeds"]) == 1 and int(fields["steps"]) == 10
    chance = float(fields["chance_acc"])
    assert abs(chance - (1 / 5 + 1 / 3) / 2) < 1e-3  # 5 demo colours, 3 shapes
    assert abs(float(fields["ratio"]) - float(fields["ours_acc"]) / chance) < 1e-2
    assert 0.0 <= float(fields["s0_colour"]) <= 1.0 and int(fields["eval_images"]) == 30
