"""Every Triton kernel lowers to a CUDA cubin (sm_80 and sm_90; bf16, fp16 and fp32)
without a register spill, using the LLVM and ptxas that ship inside Triton: the
interpreter tests prove the arithmetic, this proves the GPU build, with no GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from kvfleet_kernels.cuda_compile import KERNELS

ROOT = Path(__file__).resolve().parents[2]


def test_every_kernel_compiles_for_cuda_without_spills():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "kvfleet_kernels.cuda_compile", "--arch", "80", "90",
                           "--dtype", "bf16", "fp16", "fp32"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    cases = sum(len(variants) for *_, variants in KERNELS.values()) * 2 * 3
    assert f"{cases} of {cases} compiled without spills" in done.stdout
    assert sum(line.startswith("ok ") for line in done.stdout.splitlines()) == cases


def test_refuses_to_run_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-m", "kvfleet_kernels.cuda_compile"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and "unset TRITON_INTERPRET" in done.stderr
