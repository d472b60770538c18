"""bench.bucket_plan --quick prints both orders' batch counts and a parseable RESULT line."""

from __future__ import annotations

import re

from bench import bucket_plan


def test_quick_run_reports_both_orders_and_a_result_line(capsys):
    bucket_plan.main(["--quick"])
    lines = capsys.readouterr().out.splitlines()
    square = int(re.search(r"for (\d+) batches", lines[1]).group(1))
    bucketed = int(re.search(r"for (\d+) batches", lines[2]).group(1))
    assert square == -(-(10_000 // 2) // 24)  # today's loader: ceil(samples per rank / batch)
    assert square - 8 <= bucketed < square  # at most one short tail per bucket is dropped
    fields = dict(re.findall(r"(\w+)=(\"[^\"]*\"|\S+)", lines[-1]))
    assert lines[-1].startswith("RESULT name=bucket_plan ratio=") and fields["samples"] == "10000"
    assert float(fields["ratio"]) > 0 and float(fields["bucket_batches_per_s"]) > 0
