"""Child processes of `make demo` and `python -m workers.serve`: a Redis to use, the
kvfleet processes started and watched together, and stopped together, in order."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import redis

from jobs import heartbeats
from jobs.connection import connect
from jobs.local_redis import RedisServer

PR_SET_PDEATHSIG = 1


def reachable_redis(url: str | None) -> str | None:
    """`url` (or KVFLEET_REDIS_URL) if a Redis answers there, else None."""
    url = url or os.environ.get("KVFLEET_REDIS_URL")
    if not url:
        return None
    try:
        connect(url, socket_connect_timeout=1).ping()
        return url
    except redis.RedisError:
        print(f"{url} does not answer; starting a local redis-server", flush=True)
        return None


def start_own_redis(folder: Path):
    """A redis-server of this command's own in `folder`; SystemExit with one line when there is
    none to start (a machine without Redis installed), saying both ways out."""
    try:
        return RedisServer(folder).start()
    except RuntimeError as error:
        raise SystemExit(f"{error}; or point KVFLEET_REDIS_URL (--redis-url) at a running Redis") from None


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the parent dies, even by kill -9 (Linux),
    so that no child outlives its group."""
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class ProcessGroup:
    def __init__(self, env: dict[str, str] | None = None) -> None:
        self.processes: dict[str, subprocess.Popen] = {}
        self.env = env

    def start(self, name: str, module_args: list[str], log: Path | None = None,
              cpus: set[int] | None = None) -> subprocess.Popen:
        """`python -m MODULE ARGS...`; output to `log`, or to this process's own; on `cpus`
        only, when given (engine/cpu_runtime.py: core_plan)."""
        output = open(log, "wb") if log else None  # noqa: SIM115 (kept open for the process's life)

        def before_exec() -> None:
            _die_with_parent()
            if cpus:
                os.sched_setaffinity(0, cpus)

        process = subprocess.Popen([sys.executable, "-m", *module_args], stdout=output,
                                   stderr=subprocess.STDOUT if output else None, env=self.env,
                                   preexec_fn=before_exec if sys.platform == "linux" else None,
                                   start_new_session=True)  # a Ctrl-C reaches the parent only: it stops us in order
        self.processes[name] = process
        return process

    def check(self) -> None:
        """Raise SystemExit if a child has exited."""
        for name, process in self.processes.items():
            if process.poll() is not None:
                raise SystemExit(f"{name} exited with {process.returncode}")

    def wait_for_http(self, url: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check()
            try:
                if httpx.get(url, timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        raise SystemExit(f"{url} did not come up")

    def wait_for_model(self, r: redis.Redis, model: str, timeout: float = 300) -> None:
        """Until a worker heartbeats `model` (it loads its weights first)."""
        deadline = time.monotonic() + timeout
        while model not in heartbeats.served_models(r):
            self.check()
            if time.monotonic() > deadline:
                raise SystemExit(f"no worker served {model!r} after {timeout:.0f}s")
            time.sleep(0.2)

    def stop(self, order: list[str] | None = None, timeout: float = 20) -> None:
        """SIGTERM each child in `order` (the rest after) and wait for it; SIGKILL past
        `timeout`. Stopping one at a time lets the worker drain while the API still answers."""
        names = list(order or []) + [n for n in self.processes if n not in (order or [])]
        for name in names:
            process = self.processes.get(name)
            if process is None or process.poll() is not None:
                continue
            process.terminate()
            try:
                process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)
