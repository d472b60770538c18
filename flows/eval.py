"""Flow ``eval``: a phase's eval grid again, forced (after a change DVC does not see, or to re-sample).

    prefect deployment run 'eval/eval' -p phase=phase3 --watch
    python -m flows.eval --phase phase3

Upstream stages run (or are restored, or skipped) as in ``train-phase``; ``eval_grid@<phase>`` itself
runs with ``dvc repro --force``.
"""

from __future__ import annotations

import argparse
import json

from prefect import flow

from flows.train_phase import phase_target, run_phase


@flow(name="eval")
def eval_phase(phase: str = "phase7", stage_timeout_s: float | None = None, use_remote: bool = True) -> dict:
    """``eval_grid@<phase>`` forced, after whatever it needs."""
    return run_phase(phase, False, stage_timeout_s, phase_target(phase), use_remote)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--phase", default="phase7")
    ap.add_argument("--stage-timeout-s", type=float, default=None)
    ap.add_argument("--no-remote", action="store_true")
    args = ap.parse_args(argv)
    print(json.dumps(eval_phase(args.phase, args.stage_timeout_s, not args.no_remote), indent=2))


if __name__ == "__main__":
    main()
