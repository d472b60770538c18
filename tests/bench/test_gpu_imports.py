"""Every module ``bench/gpu/run.sh`` runs imports on the GPU machine's packages alone (the image's, the carried
wheels and their requirements): a new dependency on the training path that the image lacks fails here, in seconds,
instead of on a lent H100 (2026-11-28: ``ema_pytorch`` and ``polars`` cost a lease's first call). The slow
``test_gpu_rehearsal.py`` runs the steps themselves in such a venv; this one only imports them."""

from __future__ import annotations

import subprocess
import sys

from tests.fixtures.gpu_image import REPO, gpu_distributions, gpu_site

GPU_MODULES = [
    "bench.train_step",
    "bench.gpu.train_check",
    "bench.gpu.attention_probe",
    "bench.checkpoint_write",
    "bench.encode_pipeline",
    "stages.train",  # what train_check and the torchrun gpu test start
    "tests.gpu.test_cuda_paths",
]


def _import_with(site, modules, extra_code=""):
    """Import ``modules`` in ``python -S`` with only the repo and ``site`` on the path."""
    code = (
        f"import sys; sys.path[:0] = [{str(REPO)!r}, {str(site)!r}]\n"
        f"{extra_code}\n"
        f"import importlib\nfor name in {modules!r}:\n    importlib.import_module(name)\n"
    )
    return subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=300)


def test_the_gpu_steps_import_with_only_the_gpu_machines_packages(tmp_path):
    site = gpu_site(tmp_path / "site")
    proc = _import_with(site, GPU_MODULES, "import polars  # must fail: the image has none")
    assert "No module named 'polars'" in proc.stderr, proc.stderr[-2000:]  # the site really leaves polars out
    proc = _import_with(site, GPU_MODULES)
    assert proc.returncode == 0, (
        "a module run on the GPU machine imports a package its image lacks: carry it in bench/gpu/wheels.txt "
        "or keep it off the GPU path\n" + proc.stderr[-3000:]
    )


def test_the_gpu_package_set_has_the_carried_wheels_and_not_the_data_stack():
    have = gpu_distributions()
    assert {"torch", "transformers", "diffusers", "pydantic", "ema-pytorch"} <= have
    assert not {"polars", "mlflow", "prefect", "dvc", "webdataset", "boto3"} & have
