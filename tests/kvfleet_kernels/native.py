"""The mark for tests of the native CPU kernels in this folder: they need a C++ compiler,
and they run on the CPU only (scripts/gpu_check.py runs the folder with CUDA as torch's
default device, where `make test` has already covered them)."""

from __future__ import annotations

import pytest
import torch

from kvfleet_kernels.cpu_paged_attention import load_error

native_cpu = pytest.mark.skipif(torch.get_default_device().type != "cpu" or load_error() is not None,
                                reason="a native CPU kernel: runs on the CPU, with a C++ compiler (make test)")
