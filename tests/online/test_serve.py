"""`python -m workers.serve`: one command, a base URL, a clean stop."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import openai

from tests.services import descendants, free_port, is_alive, start_serve


def test_serve_starts_answers_and_stops_on_sigterm_leaving_nothing(demo_model, tmp_path):
    serve, port = start_serve(["--model", demo_model, "--served-model-name", "demo", "--num-kv-blocks", "128"],
                              tmp_path)
    try:
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


def test_serve_on_a_machine_without_redis_says_so_in_one_line(tmp_path):
    """No Redis answers and none is installed: one line naming both ways out, no traceback."""
    env = {**os.environ, "PATH": os.path.dirname(sys.executable), "KVFLEET_REDIS_URL": ""}
    done = subprocess.run([sys.executable, "-m", "workers.serve", "--model", "demo", "--port", str(free_port())],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert "redis-server is not installed (apt-get install redis-server); or point KVFLEET_REDIS_URL" in done.stderr
    assert "Traceback" not in done.stderr + done.stdout
