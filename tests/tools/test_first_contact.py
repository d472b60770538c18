"""First contact (issue 55, item 7): ``sdforge --help`` and a refused flag import none of the heavy libraries (they
answered in 6-8 s and ~617 MB on f92c454, importing torch, diffusers and MLflow first), and no entry point prints
the library warnings a normal run printed (transformers' torchvision fallback)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tools.cli import build_parser

HEAVY = ("torch", "diffusers", "transformers", "mlflow", "polars", "cv2")


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["generate", "--help"],
        ["generate", "--prompt", "x", "--steps", "-5"],
        ["generate", "--prompt", "x", "--guidance", "inf"],
        ["export"],
        ["export", "--out", "checkpoints/phase1"],
        ["export", "--out", "."],
    ],
)
def test_help_and_a_refused_flag_import_no_heavy_library(argv):
    code = (
        "import sys\nfrom tools.cli import main\n"
        f"try:\n    main({argv!r})\nexcept SystemExit as e:\n    code = e.code\n"
        f"print(code, sorted(m for m in {HEAVY!r} if m in sys.modules))"
    )
    done = _python(code)
    status, loaded = done.stdout.strip().splitlines()[-1].split(" ", 1)
    assert loaded == "[]", f"{argv}: imported {loaded}"
    assert status == ("0" if "--help" in argv else "2"), done.stderr
    assert "Traceback" not in done.stderr


def test_every_command_is_listed_and_preflight_keeps_its_own_options():
    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices  # noqa: SLF001 (argparse keeps them only here)
    assert set(commands) == {"generate", "export", "evaluate", "report", "runs", "tracking-flush", "check", "preflight"}
    done = subprocess.run(
        [sys.executable, "-m", "tools.cli", "preflight", "--help"], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and "--price-per-gpu-hour" in done.stdout, done.stderr


@pytest.mark.parametrize("entry", ["stages.eval_grid", "tools.cli", "flows.tasks"])
def test_no_library_warning_when_an_entry_point_loads_the_pipelines(entry):
    done = _python(f"import {entry}\nfrom diffusers import StableDiffusionPipeline\nprint('ok')")
    assert done.stdout.strip() == "ok", done.stderr
    assert "requires torchvision" not in done.stderr and "[transformers]" not in done.stderr, done.stderr
