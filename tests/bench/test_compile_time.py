"""bench.compile_time: one mode's measurement in its child process, and (slow) the whole bench on the demo UNet.

Values only; no timing is asserted."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench import compile_time

REPO = Path(__file__).resolve().parents[2]


def test_the_eager_child_reports_its_step_and_compiles_nothing():
    out = subprocess.run(
        [sys.executable, "-m", "bench.compile_time", "--quick", "--child", "off", "--device", "cpu"],
        cwd=REPO, capture_output=True, text=True, check=True,
    )  # fmt: skip
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(result) == {"compile_s", "step_s", "dynamo_s", "modules"}
    assert result["modules"] == 0 and result["dynamo_s"] == 0.0
    assert result["step_s"] > 0


def test_a_mode_past_its_limit_is_reported_not_waited_for(capsys):
    assert compile_time.run_mode("demo", "unet", "cpu", 1, limit=0.5) is None
    assert "unet: no pass within" in capsys.readouterr().out


@pytest.mark.slow
def test_the_quick_bench_compiles_both_modes_and_prints_its_result():
    out = subprocess.run(
        [sys.executable, "-m", "bench.compile_time", "--quick", "--device", "cpu"],
        cwd=REPO, capture_output=True, text=True, check=True, timeout=1800,
    )  # fmt: skip
    last = out.stdout.strip().splitlines()[-1]
    assert last.startswith("RESULT name=compile_time ratio=")
    fields = dict(re.findall(r'(\w+)=("[^"]*"|\S+)', last))
    assert float(fields["ratio"]) > 0
    assert float(fields["blocks_s"]) > 0 and float(fields["unet_s"]) > 0
    assert 'config="demo"' in last
