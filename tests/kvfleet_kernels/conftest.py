"""Where the kernel tests run: on the CPU under TRITON_INTERPRET=1 (tests/conftest.py
sets it when there is no CUDA), or, with KVFLEET_TEST_DEVICE=cuda (scripts/gpu_check.py
sets it on a GPU machine), with every tensor they make on the GPU and the kernels
compiled for it."""

from __future__ import annotations

import os

import torch

if os.environ.get("KVFLEET_TEST_DEVICE") == "cuda":
    torch.set_default_device("cuda")
