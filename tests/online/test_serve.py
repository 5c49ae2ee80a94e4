"""`python -m workers.serve`: one command, a base URL, a clean stop."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai

from tests.services import free_port


def descendants(pid: int) -> set[int]:
    """Every process below `pid`, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def is_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_serve_starts_answers_and_stops_on_sigterm_leaving_nothing(demo_model, tmp_path):
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "KVFLEET_REDIS_URL": ""}  # no Redis given: it starts its own
    log = open(tmp_path / "serve.log", "w+")  # noqa: SIM115
    serve = subprocess.Popen([sys.executable, "-m", "workers.serve", "--model", demo_model, "--served-model-name",
                              "demo", "--port", str(port), "--num-kv-blocks", "128", "--drain-seconds", "5"],
                             stdout=log, stderr=subprocess.STDOUT, env=env, text=True)
    try:
        deadline = time.monotonic() + 120
        while f"http://127.0.0.1:{port}/v1" not in (tmp_path / "serve.log").read_text():
            assert serve.poll() is None and time.monotonic() < deadline, (tmp_path / "serve.log").read_text()
            time.sleep(0.2)
        children = descendants(serve.pid)
        assert len(children) >= 4  # redis-server, worker, finalizer, API
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list()] == ["demo"]
        response = client.completions.create(model="demo", prompt="Hello", max_tokens=5, temperature=0)
        assert response.usage.completion_tokens == 5
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=60) == 0, (tmp_path / "serve.log").read_text()
        deadline = time.monotonic() + 10
        while any(is_alive(pid) for pid in children):
            assert time.monotonic() < deadline, [pid for pid in children if is_alive(pid)]
            time.sleep(0.1)
    finally:
        if serve.poll() is None:
            serve.kill()
