"""Helpers the benchmarks share: the machine's name, a child process's wall time and peak RSS, the RESULT line.

Each implementation under test runs in its own subprocess (:func:`run_measured`), so its peak RSS is
its own: ``os.wait4`` returns the child's resource usage (its ``ru_maxrss`` covers the child and the
processes it waited for), not the maximum over every child this process ever had, as
``getrusage(RUSAGE_CHILDREN)`` would.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

BENCH_DATA = Path(os.environ.get("SDFORGE_BENCH_DATA", Path(__file__).resolve().parents[1] / "data" / "bench"))
"""Cached synthetic inputs (git-ignored: under ``/data/``); override with ``SDFORGE_BENCH_DATA``."""


def machine() -> str:
    """``<cpu model> x<cores usable by this process>, <total RAM> GiB RAM`` (from /proc)."""
    model = "unknown cpu"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    mem = ""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem = f", {int(line.split()[1]) / 2**20:.0f} GiB RAM"
                break
    except OSError:
        pass
    return f"{model} x{cores} cores{mem}"


@dataclass(frozen=True)
class Measured:
    """One child run: wall-clock seconds, peak resident set (MiB), CPU seconds (user + system), exit status, stdout."""

    wall_s: float
    peak_rss_mb: float
    cpu_s: float
    returncode: int
    stdout: str


def run_measured(args: list[str], env: dict[str, str] | None = None, cwd: str | Path | None = None) -> Measured:
    """Run ``args`` in a fresh process; return its wall time and its own peak RSS (stderr passes through)."""
    start = time.perf_counter()
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, env=env, cwd=cwd, text=True)
    assert proc.stdout is not None
    stdout = proc.stdout.read()  # the child ends by closing stdout; read it all before reaping
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: keep Popen from waiting again
    return Measured(wall, usage.ru_maxrss / 1024, usage.ru_utime + usage.ru_stime, proc.returncode, stdout)


def load_average() -> str:
    """``/proc/loadavg``'s 1/5/15-minute load averages (the machine may be shared)."""
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


def python_module(module: str, *args: str) -> list[str]:
    """``[sys.executable, -m, module, *args]``: a child running this interpreter (same venv)."""
    return [sys.executable, "-m", module, *args]


def result_line(name: str, ratio: float, **fields: object) -> str:
    """``RESULT name=<name> ratio=<ratio> k=v ...`` (strings quoted, floats to ~3 significant digits)."""

    def fmt(value: object) -> str:
        if isinstance(value, bool):
            return str(value).lower()
        if isinstance(value, float):
            return f"{value:.0f}" if abs(value) >= 100 else f"{value:.3g}"
        if isinstance(value, str):
            return '"' + value.replace('"', "'") + '"'
        return str(value)

    parts = [f"RESULT name={name}", f"ratio={fmt(float(ratio))}"]
    parts += [f"{key}={fmt(value)}" for key, value in fields.items()]
    return " ".join(parts)
