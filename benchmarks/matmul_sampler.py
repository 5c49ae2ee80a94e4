"""Samples a small one-thread matmul's FLOP/s every INTERVAL seconds until stopped, one figure
a line, flushed as it is taken:

    python -m benchmarks.matmul_sampler DTYPE INTERVAL [SIZE]

Run beside a benchmark process (benchmarks/common.py: sampled_matmul_speed), it says which speed
the host's matrix unit had through that run. Why: on 2-core Xeon hosts with AMX the unit is shared
with something outside the VM and flips within seconds between two speeds (a one-thread bf16
512^3 matmul ~850-980 against ~320-480 GFLOP/s), so probes before and after a run can miss the
mode it met. A sample is the best of three products (~1-2.5 ms in all at 512), so at the default
0.5 s it takes ~0.2-0.5% of one core from the run it watches."""

from __future__ import annotations

import sys
import time

import torch


def sample_flops(a: torch.Tensor, b: torch.Tensor, repeats: int = 3) -> float:
    """FLOP/s of the fastest of `repeats` products a @ b."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * a.shape[0] * a.shape[1] * b.shape[1] / best


def main() -> None:
    dtype, interval = getattr(torch, sys.argv[1]), float(sys.argv[2])
    size = int(sys.argv[3]) if len(sys.argv) > 3 else 512
    torch.set_num_threads(1)  # one core: the run keeps the rest, and a sample is that core's unit
    generator = torch.Generator().manual_seed(0)
    a, b = (torch.randn(size, size, generator=generator).to(dtype) for _ in range(2))
    sample_flops(a, b)  # the first products pick and warm oneDNN's kernel
    while True:
        print(f"{sample_flops(a, b):.6e}", flush=True)
        time.sleep(interval)


if __name__ == "__main__":
    main()
