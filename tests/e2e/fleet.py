"""Worker and finalizer processes for the fleet tests."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import redis

from jobs import batches, keys
from jobs.connection import connect
from tests.services import free_port
from tests.workers.helpers import MODEL


class Fleet:
    def __init__(self, model_dir: str, redis_url: str, logs: Path, env: dict[str, str] | None = None) -> None:
        self.model_dir, self.redis_url, self.logs = model_dir, redis_url, logs
        self.processes: dict[str, subprocess.Popen] = {}
        self.metrics_ports: dict[str, int] = {}
        # One thread each: the worker processes share this machine's two cores.
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen:
        log = open(self.logs / f"{name}.log", "wb")  # noqa: SIM115 (closed with the process)
        process = subprocess.Popen([sys.executable, *args], stdout=log, stderr=subprocess.STDOUT, env=self.env)
        self.processes[name] = process
        return process

    def start_worker(self, name: str, num_kv_blocks: int = 64, max_num_seqs: int = 16, lease_seconds: float = 3,
                     drain_seconds: float = 30, served_model_names: list[str] | None = (MODEL,),
                     extra: tuple[str, ...] = ()) -> subprocess.Popen:
        """served_model_names None: no --served-model-name, so the worker serves --model as given."""
        port = self.metrics_ports[name] = free_port()
        names = ["--served-model-name", *served_model_names] if served_model_names else []
        return self._spawn(name, [
            "-m", "workers", "--model", self.model_dir, *names, "--redis-url",
            self.redis_url, "--name", name, "--num-kv-blocks", str(num_kv_blocks), "--max-num-seqs",
            str(max_num_seqs), "--lease-seconds", str(lease_seconds), "--drain-seconds", str(drain_seconds),
            "--metrics-port", str(port), "--heartbeat-seconds", "0.2", "--log-level", "WARNING",
            "--dtype", "float32", *extra])  # fp32: the tests compare with in-process engines (tests/conftest.py)

    def start_finalizer(self, *extra: str) -> subprocess.Popen:
        return self._spawn("finalizer", ["-m", "workers.finalizer", "--redis-url", self.redis_url, *extra])

    def wait_ready(self, *names: str, timeout: float = 300) -> None:
        """Until each worker has registered its heartbeat in Redis. The bound is a fresh host's:
        a worker's first start there builds the native CPU kernels, and several workers starting
        together on two busy cores share them; a worker that exits fails at once."""
        r = connect(self.redis_url)
        deadline = time.monotonic() + timeout
        while not all(r.exists(keys.worker(name)) for name in names):
            for name in names:
                assert self.processes[name].poll() is None, self.log(name)
            assert time.monotonic() < deadline, "workers did not start: " + " | ".join(
                f"{name}: {self.log(name)[-500:]}" for name in names)
            time.sleep(0.1)

    def metric(self, name: str, metric: str) -> float:
        text = httpx.get(f"http://127.0.0.1:{self.metrics_ports[name]}/metrics", timeout=5).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(metric + "{") or line.startswith(metric + " "))

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text()[-3000:]

    def stop(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.kill()
                process.wait(timeout=10)


def wait_terminal(r: redis.Redis, batch_ids: list[str], timeout: float, fleet: Fleet | None = None) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        objects = {b: batches.batch_object(r, b) for b in batch_ids}
        if all(o["status"] in batches.TERMINAL for o in objects.values()):
            return objects
        if time.monotonic() > deadline:
            logs = {n: fleet.log(n) for n in fleet.processes} if fleet else {}
            raise AssertionError(f"batches did not end: {objects}\n{logs}")
        time.sleep(0.2)
