"""bench.equal_time's arithmetic: a budget becomes phase 1's epochs from the calibration run's fixed and per-epoch
seconds; the table prints each run's figures."""

from __future__ import annotations

from bench.equal_time import PROBE, epochs_for, table

CALIBRATION = {"phase0_s": 30.0, "phase1_s": 170.0, "phase1_step_s": 160.0, "phase1_epochs": 40}
"""Phase 0 30 s, phase 1 170 s of which 160 s are its 40 epochs' steps (4 s an epoch) and 10 s fixed."""


def test_a_budget_buys_the_epochs_its_seconds_pay_for_after_the_fixed_cost():
    assert epochs_for(200.0, CALIBRATION) == 40  # the calibration's own seconds: its own epochs
    assert epochs_for(280.0, CALIBRATION) == 60  # 80 s more at 4 s an epoch
    assert epochs_for(10.0, CALIBRATION) == 1  # never fewer than one epoch


def test_the_table_has_a_row_per_run_with_its_last_validation_loss():
    run = {"label": "mmdit", "seed": 1, "phase1_steps": 600, "train_s": 263.4, "img_s": 84.29, "val_loss": [0.2, 0.15],
           **dict.fromkeys(PROBE, 0.75)}  # fmt: skip
    rows = table([run, {**run, "val_loss": [], PROBE[0]: None}])
    assert rows[2] == "| mmdit | 1 | 600 | 263 | 84.3 | 0.1500 | 0.750 | 0.750 | 0.750 | 0.750 |"
    assert rows[3].startswith("| mmdit | 1 | 600 | 263 | 84.3 | n/a | n/a | 0.750 |") and len(rows) == 4
