"""A redis-server process of our own on a free port, for tests, benchmarks and
`make demo` when no Redis is configured. AOF is on (appendfsync everysec), so a
killed and restarted server keeps what it had acknowledged a second earlier."""

from __future__ import annotations

import random
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import redis


def free_port() -> int:
    """A port free now, below Linux's ephemeral range (32768-60999): a port the kernel hands out
    for port 0 is also the source port of any outgoing connection, so between this check and the
    listener's bind a client connection could take it (a worker's metrics port was lost so)."""
    for _ in range(1000):
        port = random.randrange(20000, 32768)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port between 20000 and 32767")


def free_cluster_port() -> int:
    """A free port whose cluster bus port (the port + 10000) is free too."""
    for _ in range(1000):
        port = random.randrange(20000, 55000)
        with socket.socket() as first, socket.socket() as second:
            try:
                first.bind(("127.0.0.1", port))
                second.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair for a cluster node")


class RedisServer:
    """redis-server on a free port with AOF in its own folder (appendfsync everysec, or
always: then a kill -9 loses nothing that was acknowledged)."""

    def __init__(self, folder: Path, port: int | None = None, appendfsync: str = "everysec",
                 cluster: bool = False) -> None:
        self.folder, self.port, self.appendfsync, self.cluster = Path(folder), port or free_port(), appendfsync, cluster
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
             "--appendonly", "yes", "--appendfsync", self.appendfsync, "--protected-mode", "no",
             *(["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "2000"]
               if self.cluster else [])],
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


class RedisClusterServers:
    """A local Redis Cluster for tests and benchmarks: redis-servers in cluster mode on free
    ports, joined with `redis-cli --cluster create`: `num_masters`, each with `num_replicas`."""

    def __init__(self, folder: Path, num_masters: int = 3, num_replicas: int = 0) -> None:
        self.num_replicas = num_replicas
        self.nodes = [RedisServer(Path(folder) / f"node{i}", port=free_cluster_port(), cluster=True)
                      for i in range(num_masters * (1 + num_replicas))]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{node.port}" for node in self.nodes) + "/"

    def start(self) -> RedisClusterServers:
        for node in self.nodes:
            node.start()
        subprocess.run([shutil.which("redis-cli"), "--cluster", "create",
                        *(f"127.0.0.1:{node.port}" for node in self.nodes),
                        "--cluster-replicas", str(self.num_replicas), "--cluster-yes"],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=60)
        deadline = time.monotonic() + 30
        while any(redis.Redis(port=node.port).cluster("info")["cluster_state"] != "ok" for node in self.nodes) \
                or len(self.masters()) * (1 + self.num_replicas) != len(self.nodes):
            if time.monotonic() > deadline:
                raise RuntimeError("the cluster did not reach state ok")
            time.sleep(0.1)
        return self

    def masters(self) -> list[int]:
        """The ports of the nodes that are masters now."""
        return [node.port for node in self.nodes
                if node.process.poll() is None and redis.Redis(port=node.port).role()[0] == b"master"]

    def stop(self) -> None:
        for node in self.nodes:
            node.kill(signal.SIGTERM)
