"""A worker spanning two ranks (--tensor-parallel-size 2, gloo) runs a batch end to end;
kill -9 of its rank-1 process makes it exit non-zero, and a second worker completes
the batch exactly once."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from engine import LLM, SamplingParams
from jobs import batches
from tests.e2e.fleet import wait_terminal
from tests.services import descendants
from tests.workers.helpers import completion, read_lines, submit_lines


def rank_processes(pid: int) -> list[int]:
    """The spawned ranks below a worker (multiprocessing's spawn_main; not its resource tracker)."""
    return [child for child in descendants(pid)
            if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes()]


def test_a_tp2_worker_runs_a_batch_and_a_dead_rank_loses_nothing(fleet, r, tiny_llama):
    worker = fleet.start_worker("tp2", lease_seconds=3, extra=("--tensor-parallel-size", "2"))
    fleet.wait_ready("tp2")
    [rank1] = rank_processes(worker.pid)

    prompts = [f"the fleet runs request {i}" for i in range(6)]
    first = submit_lines(r, [completion(f"a{i}", prompt, max_tokens=8) for i, prompt in enumerate(prompts)])
    done = wait_terminal(r, [first], 120, fleet)[first]
    assert done["status"] == "completed" and done["request_counts"]["completed"] == 6
    expected = LLM(tiny_llama, num_kv_blocks=64).generate(prompts, SamplingParams(temperature=0, max_tokens=8),
                                                          use_tqdm=False)
    texts = {line["custom_id"]: line["response"]["body"]["choices"][0]["text"]
             for line in read_lines(r, done["output_file_id"])}
    assert texts == {f"a{i}": output.text for i, output in enumerate(expected)}

    records = [completion(f"b{i}", f"a longer request {i}", max_tokens=60, ignore_eos=True) for i in range(24)]
    second = submit_lines(r, records)
    deadline = time.monotonic() + 60
    while not batches.num_counted(r, second):  # the worker is well into the batch
        assert time.monotonic() < deadline, fleet.log("tp2")
        time.sleep(0.05)
    os.kill(rank1, signal.SIGKILL)
    assert worker.wait(timeout=120) != 0, fleet.log("tp2")
    assert "tensor-parallel" in fleet.log("tp2")

    fleet.start_worker("single", lease_seconds=3)
    done = wait_terminal(r, [second], 180, fleet)[second]
    assert done["request_counts"] == {"total": 24, "completed": 24, "failed": 0}
    lines = read_lines(r, done["output_file_id"])
    assert sorted(line["custom_id"] for line in lines) == sorted(f"b{i}" for i in range(24))  # once each
