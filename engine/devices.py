"""Where the engine's host-side tensors live, whatever the caller set as torch's default.

The runners build each step's inputs (token ids, positions, block tables, slot mappings)
with device-less factories: host tensors, pinned and copied to the model's device once.
A caller that set another default device (torch.set_default_device("cuda"), as the GPU
kernel tests do, or a notebook) would put them on that device instead, where pinning
fails. `host_default_device` restores the CPU default for a step; entering a device
context costs a Python call on every torch op, so it does so only when needed.

`repeat_interleave` builds the per-token index tensors of a step without waking torch's
thread pool (below).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import numpy as np
import torch


def host_default_device() -> contextlib.AbstractContextManager:
    """A context in which device-less torch factories make CPU tensors, as in a plain process."""
    if torch.get_default_device().type == "cpu":
        return contextlib.nullcontext()
    return torch.device("cpu")


def repeat_interleave(values: torch.Tensor | Sequence[int], repeats: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """values[i] repeated repeats[i] times, as a host tensor of values' dtype: torch.repeat_interleave
    for a step's small host index tensors. Torch's CPU kernel opens an OpenMP region with a
    grain of one element, so every call waits for each thread of the pool to wake and join;
    measured at ~0.5 ms a call with one of two cores busy, and ~4.6 ms a step on a 16-core GPU
    host, for a few dozen elements. numpy's repeat runs on the calling thread (~2 us)."""
    values = values.numpy() if isinstance(values, torch.Tensor) else np.asarray(values, dtype=np.int64)
    repeats = repeats.numpy() if isinstance(repeats, torch.Tensor) else np.asarray(repeats, dtype=np.int64)
    return torch.from_numpy(np.repeat(values, repeats))
