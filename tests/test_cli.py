"""The `kvfleet` command: every fleet CLI under one name, `status` as a table and a
progress bar with an ETA."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from jobs import batches
from jobs.recording import record_result
from jobs.results import error_line, success_line
from jobs.storage import RedisStorage
from kvfleet.cli import COMMANDS
from kvfleet.cli import main as kvfleet
from tests.workers.helpers import completion, submit_lines

KVFLEET = Path(sys.executable).parent / "kvfleet"  # the console script pip installed
ROOT = Path(__file__).resolve().parents[1]


def test_kvfleet_help_lists_every_subcommand():
    assert KVFLEET.exists(), "pip install -e . installs the kvfleet script"
    done = subprocess.run([str(KVFLEET), "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0
    for name in ("submit", "status", "api", "worker", "finalizer", "serve", "run-batch", "demo"):
        assert f"    {name}" in done.stdout, name
    assert set(COMMANDS) == {"submit", "status", "api", "worker", "finalizer", "serve", "run-batch", "demo"}


@pytest.mark.parametrize(("command", "option"), [
    ("submit", "--skip-invalid"), ("status", "--watch"), ("api", "--port"), ("worker", "--tensor-parallel-size"),
    ("finalizer", "--sweep-seconds"), ("serve", "--model"), ("run-batch", "--output"), ("demo", "--prompts")])
def test_each_subcommand_is_its_module_s_cli(command, option, capsys):
    with pytest.raises(SystemExit) as exited:
        kvfleet([command, "--help"])
    assert exited.value.code == 0 and option in capsys.readouterr().out


def test_status_without_an_id_lists_recent_batches(r, redis_server, capsys):
    first = submit_lines(r, [completion("a", "x")])
    second = submit_lines(r, [completion(f"c{i}", "y") for i in range(3)])
    record_result(r, RedisStorage(r), second, error_line("c0", "invalid_request", "no"))
    assert kvfleet(["status", "--redis-url", redis_server.url]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["BATCH", "STATUS", "MODEL", "DONE", "FAILED", "AGE", "DUE"]
    assert lines[1].split()[:5] == [second, "in_progress", "tiny", "1/3", "1"]  # newest first
    assert lines[2].split()[:5] == [first, "in_progress", "tiny", "0/1", "0"]
    # Open batches: the ETA against the 24 h deadline. `first` has no result and no worker: no ETA.
    assert re.search(r"ETA \d+s, deadline (24\.0h|1\.0d)$", lines[1]), lines[1]
    assert re.search(r"ETA —, deadline (24\.0h|1\.0d)$", lines[2]), lines[2]


def test_status_watch_draws_a_progress_bar_with_an_eta_until_the_batch_ends(r, redis_server, capsys):
    batch_id = submit_lines(r, [completion(f"c{i}", "x") for i in range(4)])

    def finish_slowly():
        for i in range(4):
            time.sleep(0.3)
            record_result(r, RedisStorage(r), batch_id, success_line(f"c{i}", {}),
                          ack=None, partition=0)
        batches.transition(r, batch_id, "completed")

    threading.Thread(target=finish_slowly, daemon=True).start()
    assert kvfleet(["status", batch_id, "--watch", "--interval", "0.1", "--redis-url", redis_server.url]) == 0
    captured = capsys.readouterr()
    assert "4/4" in captured.err and "req/s" in captured.err and "<" in captured.err  # elapsed<remaining
    assert captured.out.splitlines()[0] == f"{batch_id}  completed  4 completed, 0 failed of 4"


def test_status_names_an_unreachable_redis(capsys):
    assert kvfleet(["status", "--redis-url", "redis://127.0.0.1:1/0"]) == 2
    assert "cannot reach Redis at redis://127.0.0.1:1/0" in capsys.readouterr().err


def test_make_demo_s_command_runs_the_main_job_end_to_end(tmp_path):
    """What `make demo` runs, on the embedded defaults: every prompt of the example file completes."""
    env = {k: v for k, v in os.environ.items() if k not in ("KVFLEET_ALLOWED_OUTPUTS", "KVFLEET_REDIS_URL")}
    done = subprocess.run([sys.executable, "-m", "workers.demo", "--prompts", str(ROOT / "examples" / "prompts.jsonl"),
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    num_prompts = sum(1 for line in (ROOT / "examples" / "prompts.jsonl").read_text().splitlines() if line.strip())
    assert f"completed, {num_prompts} completed, 0 failed" in done.stdout
    assert len((tmp_path / "output.jsonl").read_text().splitlines()) == num_prompts
    # SmolLM2-135M-Instruct answers (greedy, so always the same words), printed beside its question.
    assert "> What is the capital of France?\nThe capital of France is Paris.\n" in done.stdout
    # The demo says which path ran: on the CPU its Q4_1 file computes as it is, 4 bits a weight.
    assert re.search(r"worker demo-worker: demo; weights GGUF Q4_1\S* kept quantized", done.stdout), done.stdout[:500]
