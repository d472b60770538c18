"""The GPU machine's situation rebuilt on CPU: ``bench/gpu/run.sh --device cpu --quick`` in a fresh venv holding
only torch and the GPU image's packages, plus the wheels ``bench/gpu/pack.sh`` packs — so a missing wheel or an
import of a package the image lacks fails here, not on a lent H100. Slow (a venv install, ~3-5 min).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.gpu_image import IMAGE_PACKAGES

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


def _copy_tree(dest: Path) -> None:
    """The repository's tracked and not-ignored files (what a device call sends), nothing else."""
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, capture_output=True, check=True
    ).stdout.split(b"\0")
    for rel in filter(None, (name.decode() for name in listed)):
        src = REPO / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def _run_sh(repo: Path, env: dict, timeout: int) -> subprocess.CompletedProcess:
    """``bench/gpu/run.sh --device cpu --quick`` in the copied repo."""
    cmd = ["bash", "bench/gpu/run.sh", "--device", "cpu", "--quick"]
    return subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=timeout)


def test_run_sh_passes_on_the_gpu_package_set_plus_packed_wheels(tmp_path):
    repo, venv, out = tmp_path / "repo", tmp_path / "venv", tmp_path / "out"
    _copy_tree(repo)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    subprocess.run([py, "-m", "pip", "install", "-q", *IMAGE_PACKAGES], check=True, timeout=900)
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    packed = subprocess.run(
        ["bash", "bench/gpu/pack.sh", version],
        cwd=repo,
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert packed.returncode == 0, packed.stderr[-2000:]
    assert "of 64 MiB" in packed.stdout
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(PYTHON=str(py), OUT=str(out), PATH=f"{venv / 'bin'}:{env['PATH']}")
    run = _run_sh(repo, env, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    summary = (out / "summary.txt").read_text()
    rows = {line.split()[0]: line.split()[1] for line in summary.splitlines()[2:] if line and not line.startswith(" ")}
    steps = ("tests", "train_step", "mmdit", "sdxl_lora", "attention", "checkpoint", "train_check", "switches",
             "encode")  # fmt: skip
    assert rows == dict.fromkeys(steps, "0"), summary
    results = (out / "results.txt").read_text().splitlines()
    assert [line.split()[1] for line in results] == [
        "name=attention_probe", "name=checkpoint_write", "name=encode_pipeline", "name=train_step",
        "name=train_step", "name=train_step", "name=train_check", "name=train_step",
    ]  # fmt: skip
    assert "graphs=step" in summary and 'family="mmdit"' in summary  # train.cuda_graphs' plumbing; the MM-DiT's
    assert 'adapter="lora-r8-fp32"' in summary and 'family="sdxl"' in summary  # the SDXL LoRA step's
    assert "stall_s=" in next(r for r in results if "checkpoint_write" in r)
    assert "ok=true" in next(r for r in results if "train_check" in r) and "resumed_bit_identical=true" in summary
    assert "transformers 5.17.0" in summary and "skipped" in summary  # the image's transformers; gpu tests skip on CPU
    again = _run_sh(repo, env, timeout=300)
    assert again.returncode == 0 and again.stdout.count("done in an earlier call") == len(steps), again.stdout[-3000:]
