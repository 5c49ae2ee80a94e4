"""A redis-server process of our own on a free port, for tests, benchmarks and
`make demo` when no Redis is configured. AOF is on (appendfsync everysec), so a
killed and restarted server keeps what it had acknowledged a second earlier."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import redis


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RedisServer:
    """redis-server on a free port with AOF in its own folder (appendfsync everysec, or
always: then a kill -9 loses nothing that was acknowledged)."""

    def __init__(self, folder: Path, port: int | None = None, appendfsync: str = "everysec") -> None:
        self.folder, self.port, self.appendfsync = Path(folder), port or free_port(), appendfsync
        self.folder.mkdir(parents=True, exist_ok=True)
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        self.process = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.folder), "--save", "",
             "--appendonly", "yes", "--appendfsync", self.appendfsync, "--protected-mode", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                return self
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    raise RuntimeError(f"redis-server did not start on port {self.port}") from None
                time.sleep(0.05)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.process and self.process.poll() is None:
            self.process.send_signal(sig)
            self.process.wait(timeout=10)
