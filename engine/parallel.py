"""Tensor-parallel state and collectives (torch.distributed: NCCL on CUDA, gloo on the CPU).

One engine spans a group of `tensor_parallel_size` processes. Rank 0 is the engine
process: it schedules, owns the block manager and samples. Ranks 1..N-1 are processes
it spawns (engine/shard.py); each holds its shard of the weights and its own KV pool,
and runs every step on the inputs rank 0 broadcasts. With a group of one nothing here
communicates, and the model layers are plain torch ones.
"""

from __future__ import annotations

import contextlib
import datetime
import os

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_SECONDS = 120.0


class ParallelGroupError(RuntimeError):
    """A rank of the tensor-parallel group died or a collective failed or timed out:
    this engine cannot go on, and its process should exit."""


_rank, _world_size = 0, 1


def tp_rank() -> int:
    return _rank


def tp_size() -> int:
    return _world_size


@contextlib.contextmanager
def rank_view(rank: int, world_size: int):
    """Build layers as rank `rank` of `world_size` would, without a group (nothing may
    communicate inside): for counting a shard's parameters."""
    global _rank, _world_size
    saved = _rank, _world_size
    _rank, _world_size = rank, world_size
    try:
        yield
    finally:
        _rank, _world_size = saved


def collective_timeout() -> float:
    return float(os.environ.get("KVFLEET_TP_TIMEOUT", DEFAULT_TIMEOUT_SECONDS))


def init_group(rank: int, world_size: int, init_method: str, device: torch.device) -> None:
    """Join the group (every rank calls this with the same init_method)."""
    global _rank, _world_size
    _rank, _world_size = rank, world_size
    if world_size == 1:
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=collective_timeout()))


def destroy_group() -> None:
    global _rank, _world_size
    if _world_size > 1 and dist.is_initialized():
        dist.destroy_process_group()
    _rank, _world_size = 0, 1


def all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """Sum over the group, in place (a no-op for a group of one)."""
    if _world_size > 1:
        dist.all_reduce(tensor)
    return tensor


def broadcast(tensor: torch.Tensor) -> torch.Tensor:
    """Rank 0's tensor, in place on every rank."""
    if _world_size > 1:
        dist.broadcast(tensor, src=0)
    return tensor


def group_min(value: int, device: torch.device) -> int:
    """The smallest of every rank's value (e.g. the KV blocks each rank's memory holds)."""
    if _world_size == 1:
        return value
    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
    return int(tensor.item())


def check_tensor_parallel(hf_config, world_size: int, device: torch.device) -> None:
    """Before any process starts: the sizes a group of `world_size` must divide, and the devices."""
    divide(hf_config.num_attention_heads, world_size, "num_attention_heads")
    with rank_view(0, world_size):  # the split every rank will make, or its error
        kv_head_range(getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads)
    for field in ("intermediate_size", "ffn_dim", "moe_intermediate_size"):
        if getattr(hf_config, field, None):
            divide(getattr(hf_config, field), world_size, field)
    if device.type == "cuda" and (device.index or 0) + world_size > torch.cuda.device_count():
        raise ValueError(f"tensor_parallel_size {world_size} needs {world_size} GPUs from {device}; "
                         f"{torch.cuda.device_count()} are visible")


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"tensor_parallel_size {denominator} does not divide {what} ({numerator})")
    return numerator // denominator


def shard_range(size: int) -> tuple[int, int]:
    """This rank's [start, end) of a dimension split evenly over the group."""
    local = divide(size, _world_size, "a sharded dimension")
    return _rank * local, (_rank + 1) * local


def kv_head_range(num_kv_heads: int) -> tuple[int, int]:
    """This rank's KV heads: an even split, or, with more ranks than KV heads, one head
    replicated on tensor_parallel_size / num_kv_heads ranks (as vLLM does)."""
    if _world_size <= num_kv_heads:
        local = divide(num_kv_heads, _world_size, "num_key_value_heads")
        return _rank * local, (_rank + 1) * local
    if _world_size % num_kv_heads:
        raise ValueError(f"tensor_parallel_size {_world_size} is larger than num_key_value_heads "
                         f"({num_kv_heads}) and not a multiple of it: the KV heads cannot be replicated evenly")
    head = _rank * num_kv_heads // _world_size
    return head, head + 1
