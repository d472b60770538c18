"""Which scaled-dot-product-attention kernel SD1.5's attention shapes actually get, and what each costs.

``python -m bench.gpu.attention_probe [--quick] [--batch B] [--device cuda|cpu]``

SD1.5's UNet has 8 heads: head size 40 at 64×64 latents (4096 tokens), 80 at 32×32 (1024), 160 at 16×16 (256)
and 8×8 (64); cross-attention has 77 keys. For each (head size, tokens, self/cross) this runs forward +
backward in bf16 (CUDA; fp32 on a CPU) with each backend alone (``torch.nn.attention.sdpa_kernel``: cudnn,
flash, efficient, math) and with torch's own choice, and reports which ran and their median time. What
``train.attention`` should be set to follows from the table. Last line: ``RESULT name=attention_probe
ratio=<math ms ÷ auto ms, summed over the shapes> auto_ms=... math_ms=... best=<backend per head size> ...``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel

from bench._common import machine, result_line
from model.speed import ATTENTION

SHAPES = [(40, 4096, 4096), (40, 4096, 77), (80, 1024, 1024), (80, 1024, 77), (160, 256, 256), (160, 256, 77),
          (160, 64, 64)]  # fmt: skip
"""(head size, query tokens, key tokens) of SD1.5's attention at 64×64 latents."""
HEADS = 8


def _time(fn, repeat: int, device: torch.device) -> float:
    """Median milliseconds of ``fn()`` over ``repeat`` calls after one warm-up."""
    fn()
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def probe(shape, batch: int, device: torch.device, repeat: int) -> dict[str, float | None]:
    """Milliseconds of one forward + backward per backend (None: not available for this shape)."""
    dim, q_len, k_len = shape
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    q = torch.randn(batch, HEADS, q_len, dim, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(batch, HEADS, k_len, dim, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(batch, HEADS, k_len, dim, device=device, dtype=dtype, requires_grad=True)

    def step():
        F.scaled_dot_product_attention(q, k, v).float().sum().backward()

    out: dict[str, float | None] = {"auto": _time(step, repeat, device)}
    for name, backend in ATTENTION.items():
        try:
            with sdpa_kernel([backend]):
                out[name] = _time(step, repeat, device)
        except RuntimeError:  # "No available kernel": not for this shape, dtype or device
            out[name] = None
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="batch 1, 2 repeats (CPU rehearsal)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    device, batch, repeat = torch.device(args.device), 1 if args.quick else args.batch, 2 if args.quick else 10
    shapes = SHAPES[-3:] if args.quick else SHAPES
    gpu = f", {torch.cuda.get_device_name()}" if device.type == "cuda" else ""
    print(f"machine: {machine()}{gpu}; torch {torch.__version__}; batch {batch} × {HEADS} heads")
    rows = {shape: probe(shape, batch, device, repeat) for shape in shapes}
    names = ["auto", *ATTENTION]
    print("head  q_len  k_len  " + "  ".join(f"{n:>9}" for n in names) + "   (ms, forward + backward)")
    for (dim, q_len, k_len), row in rows.items():
        cells = "  ".join(f"{row[n]:9.3f}" if row[n] is not None else f"{'-':>9}" for n in names)
        print(f"{dim:4}  {q_len:5}  {k_len:5}  {cells}")
    best = {}
    for dim in sorted({d for d, _, _ in rows}):  # the backend that runs every shape of a head size fastest
        mine = [row for (d, _, _), row in rows.items() if d == dim]
        ran = {n: sum(r[n] for r in mine) for n in ATTENTION if all(r[n] is not None for r in mine)}
        best[dim] = min(ran, key=ran.get) if ran else "none"
    auto_ms = sum(r["auto"] for r in rows.values())
    math_ms = sum(r["math"] or 0.0 for r in rows.values())
    print(result_line("attention_probe", math_ms / auto_ms, auto_ms=auto_ms, math_ms=math_ms,
                      best=",".join(f"{d}:{b}" for d, b in best.items()), device=device.type,
                      machine=machine() + gpu))  # fmt: skip


if __name__ == "__main__":
    main()
