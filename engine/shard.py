"""Ranks 1..N-1 of a tensor-parallel engine, and the step inputs rank 0 sends them.

Rank 0 (the engine process) spawns one process per other rank (their main is
engine/model_runner.py's `run_shard`). Each loads its shard
of the weights, sizes its KV pool, and then runs every step: rank 0 broadcasts the
step's inputs (token ids, context starts and lengths, block tables, block copies, the
rows to sample), every rank builds positions, slot mappings and attention metadata
from them the same way, runs its shard, and takes part in the logits gather.

Why torch.distributed broadcasts rather than shared memory and an event (nano-vllm's
choice): the inputs travel on the same channel as the collectives, so a dead or stuck
rank fails both the same way, with the group's timeout instead of a wait forever on
an event; and nothing is pickled. It costs two small broadcasts a step.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import socket
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine import parallel
from engine.config import EngineConfig

STEP, EXIT = 1, 0
HEADER_SIZE = 8  # STEP or EXIT, then the sizes of the step's tensors


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T] the step's tokens, prefills first
    starts: torch.Tensor  # [S] tokens already in the cache per sequence
    lens: torch.Tensor  # [S] tokens of each sequence this step
    block_tables: torch.Tensor  # [S, W] padded with 0
    copies: torch.Tensor  # [C, 3] (KV pool, source, destination) blocks to copy first
    rows: torch.Tensor  # [R] rows of the flat batch whose logits are sampled
    seq_lens: torch.Tensor  # [S] tokens per sequence, prompt and output (longrope picks its table by them)
    sliding_block_tables: torch.Tensor  # [S, W'] a hybrid model's sliding pool ([S, 0] otherwise)
    lora_slots: torch.Tensor  # [S] each sequence's adapter slot, -1: the base model
    lora_loads: torch.Tensor  # [B] uint8: JSON [[slot, name, path], ...], adapters to load first (engine/lora/)

    def adapters_to_load(self) -> list[tuple[int, str, str]]:
        return [tuple(load) for load in json.loads(bytes(self.lora_loads.tolist()) or b"[]")]

    def broadcast(self, device: torch.device) -> None:
        """Rank 0: send these inputs to every other rank."""
        sizes = [len(self.input_ids), len(self.starts), self.block_tables.shape[1], len(self.copies), len(self.rows),
                 self.sliding_block_tables.shape[1], len(self.lora_loads)]
        parallel.broadcast(torch.tensor([STEP, *sizes], dtype=torch.int64, device=device))
        parallel.broadcast(torch.cat([self.input_ids, self.starts, self.lens, self.block_tables.flatten(),
                                      self.copies.flatten(), self.rows, self.seq_lens,
                                      self.sliding_block_tables.flatten(), self.lora_slots, self.lora_loads])
                           .to(device=device, dtype=torch.int64))

    @staticmethod
    def receive(device: torch.device) -> StepInputs | None:
        """Ranks 1..N-1: the next step's inputs, or None when rank 0 shuts the group down."""
        header = parallel.broadcast(torch.zeros(HEADER_SIZE, dtype=torch.int64, device=device)).tolist()
        if header[0] == EXIT:
            return None
        num_tokens, num_seqs, width, num_copies, num_rows, sliding_width, num_load_bytes = header[1:]
        sizes = [num_tokens, num_seqs, num_seqs, num_seqs * width, 3 * num_copies, num_rows, num_seqs,
                 num_seqs * sliding_width, num_seqs, num_load_bytes]
        payload = torch.zeros(sum(sizes), dtype=torch.int64, device=device)
        parts = parallel.broadcast(payload).cpu().split(sizes)
        return StepInputs(parts[0], parts[1], parts[2], parts[3].view(num_seqs, width), parts[4].view(-1, 3),
                          parts[5], parts[6], parts[7].view(num_seqs, sliding_width), parts[8],
                          parts[9].to(torch.uint8))


def send_exit(device: torch.device) -> None:
    parallel.broadcast(torch.tensor([EXIT] + [0] * (HEADER_SIZE - 1), dtype=torch.int64, device=device))


def free_init_method() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{sock.getsockname()[1]}"


def start_shards(config: EngineConfig, init_method: str,
                 shard_main: Callable[[str, int, str], None]) -> list[multiprocessing.Process]:
    """Spawn ranks 1..N-1, each running `shard_main(config_json, rank, init_method)`
    (engine/model_runner.py's `run_shard`; passed in, so that this module needs no model
    runner). Spawn, not fork: a forked child would inherit rank 0's threads and CUDA state.
    The config travels as JSON."""
    context = multiprocessing.get_context("spawn")
    config_json = json.dumps(dataclasses.asdict(config))
    shards = []
    for rank in range(1, config.tensor_parallel_size):
        process = context.Process(target=shard_main, args=(config_json, rank, init_method), daemon=True,
                                  name=f"kvfleet-tp-rank-{rank}")
        process.start()
        shards.append(process)
    return shards
