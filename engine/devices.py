"""Where the engine's host-side tensors live, whatever the caller set as torch's default.

The runners build each step's inputs (token ids, positions, block tables, slot mappings)
with device-less factories: host tensors, pinned and copied to the model's device once.
A caller that set another default device (torch.set_default_device("cuda"), as the GPU
kernel tests do, or a notebook) would put them on that device instead, where pinning
fails. `host_default_device` restores the CPU default for a step; entering a device
context costs a Python call on every torch op, so it does so only when needed.
"""

from __future__ import annotations

import contextlib

import torch


def host_default_device() -> contextlib.AbstractContextManager:
    """A context in which device-less torch factories make CPU tensors, as in a plain process."""
    if torch.get_default_device().type == "cpu":
        return contextlib.nullcontext()
    return torch.device("cpu")
