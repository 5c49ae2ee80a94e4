"""Two workers with two adapter slots each and six adapters in the queue: loads stay near one
per adapter across the fleet, and every request completes exactly once with the answer
LLM.generate gives with its adapter. How the adapters split between the workers depends on
who gets the CPU first (one starved worker may take none); the choice itself is tested on a
fake clock in tests/workers/test_adapter_preference.py."""

from __future__ import annotations

import time

from engine import LLM, LoRARequest, SamplingParams
from jobs import heartbeats
from tests.e2e.fleet import wait_terminal
from tests.lora_adapters import EIGHT, write_adapter
from tests.workers.helpers import completion, read_lines, submit_lines

NUM_ADAPTERS, PER_ADAPTER, MAX_TOKENS = 6, 8, 64  # each worker runs for seconds, past their start skew


def test_two_workers_split_six_adapters_and_finish_each_request_once(fleet, r, tiny_llama, tmp_path):
    folders = {f"adapter-{i}": write_adapter(tiny_llama, tmp_path / f"adapter-{i}", EIGHT[i], seed=i, scale=0.3)
               for i in range(NUM_ADAPTERS)}
    lora = ("--enable-lora", "--max-loras", "2", "--max-lora-rank", "64", "--lora-wait-seconds", "30",
            "--lora-modules", *[f"{name}={folder}" for name, folder in folders.items()])
    for worker in ("w1", "w2"):
        fleet.start_worker(worker, extra=lora)
    fleet.wait_ready("w1", "w2")
    batch_ids = {name: submit_lines(r, [completion(f"{name}-{j}", f"request {j} for {name}", max_tokens=MAX_TOKENS,
                                                   ignore_eos=True)
                                        for j in range(PER_ADAPTER)], model=name) for name in folders}
    done = wait_terminal(r, list(batch_ids.values()), 180, fleet)
    loads = fresh_lora_loads(r, {"w1", "w2"})

    reference = LLM(tiny_llama, num_kv_blocks=256, enable_lora=True, max_loras=2, max_lora_rank=64)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for name, batch_id in batch_ids.items():
        assert done[batch_id]["request_counts"] == {"total": PER_ADAPTER, "completed": PER_ADAPTER, "failed": 0}
        lines = read_lines(r, done[batch_id]["output_file_id"])
        assert sorted(line["custom_id"] for line in lines) == sorted(f"{name}-{j}" for j in range(PER_ADAPTER))
        prompts = [f"request {j} for {name}" for j in range(PER_ADAPTER)]
        expected = reference.generate(prompts, params, use_tqdm=False, lora_request=LoRARequest(name, 1, str(folders[name])))
        texts = {line["custom_id"]: line["response"]["body"]["choices"][0]["text"] for line in lines}
        assert texts == {f"{name}-{j}": output.text for j, output in enumerate(expected)}
    # Each adapter loaded once somewhere, a few more as the two start together; without pulling
    # by adapter both workers would load most of the six (about twelve loads).
    assert NUM_ADAPTERS <= sum(loads.values()) <= NUM_ADAPTERS + 2, loads


def fresh_lora_loads(r, names: set[str], timeout: float = 10.0) -> dict[str, int]:
    """Each worker's lora_loads from a heartbeat written after this call: the batches can end
    between a worker's last load and its next heartbeat."""
    since = time.time()
    deadline = time.monotonic() + timeout
    while True:
        records = {record["name"]: record for record in heartbeats.live_workers(r)}
        if set(records) == names and all(record["heartbeat"] > since for record in records.values()):
            return {name: record["lora_loads"] for name, record in records.items()}
        assert time.monotonic() < deadline, records
        time.sleep(0.05)
