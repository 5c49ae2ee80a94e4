"""Real services for tests: a redis-server each test session starts itself (so
tests can kill and restart it) and moto's S3-compatible HTTP server."""

from __future__ import annotations

import threading
import time

import uvicorn
from rq import SimpleWorker
from rq.serializers import JSONSerializer

from jobs.finalize import finalize_queue
from jobs.local_redis import RedisServer, free_port  # noqa: F401 (re-exported for tests)


def run_finalize_jobs(r) -> int:
    """Run every queued finalize job in this process, as `workers.finalizer` would; how many."""
    queue = finalize_queue(r)
    num_jobs = queue.count
    if num_jobs:
        SimpleWorker([queue], connection=r, serializer=JSONSerializer).work(burst=True)
    return num_jobs


class S3Server:
    """moto's ThreadedMotoServer: a real S3-compatible HTTP endpoint."""

    def __init__(self, port: int | None = None) -> None:
        from moto.server import ThreadedMotoServer

        self.port = port or free_port()
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> S3Server:
        self.server.start()
        return self

    def stop(self) -> None:
        self.server.stop()


class ThreadedUvicorn:
    """An ASGI app served by uvicorn on a free port, in a thread of the test process."""

    def __init__(self, app) -> None:
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ThreadedUvicorn:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def s3_environment(endpoint_url: str) -> dict[str, str]:
    return {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
            "KVFLEET_S3_ENDPOINT_URL": endpoint_url}
