"""The worker's probes: /healthz (ready) and /livez (the loop turns), next to /metrics."""

from __future__ import annotations

import time

import httpx
import pytest

from engine import EngineConfig, LLMEngine
from tests.services import free_port
from tests.workers.helpers import MODEL
from workers.health import Health, serve, stop_serving
from workers.metrics import WorkerMetrics
from workers.worker import Worker, WorkerOptions


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def probes():
    clock, metrics = Clock(), WorkerMetrics("w", MODEL)
    health = Health(stall_seconds=30, clock=clock)
    port = free_port()
    server = serve(port, metrics.registry, health, host="127.0.0.1")
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=5) as client:
        yield client, health, clock, metrics
    stop_serving(server)


def test_ready_only_when_loaded_and_joined_and_not_draining(probes, tiny_llama, r):
    client, health, _, metrics = probes
    loading = client.get("/healthz")
    assert loading.status_code == 503 and loading.json()["loaded"] is False
    assert client.get("/livez").status_code == 200  # loading is alive
    worker = Worker(LLMEngine(EngineConfig(model=tiny_llama, num_kv_blocks=16)), r,
                    WorkerOptions(name="w", served_model_names=[MODEL], block_ms=10), metrics, health)
    assert client.get("/healthz").json() == {"status": "unavailable", "loaded": True, "joined": False,
                                             "draining": False}
    worker.run_once()  # creates the consumer groups
    assert client.get("/healthz").status_code == 200
    assert "kvfleet:num_requests_running{" in client.get("/metrics").text
    worker.request_stop()
    assert client.get("/healthz").json()["draining"] is True
    assert client.get("/healthz").status_code == 503


def test_live_until_the_loop_stalls(probes):
    client, health, clock, _ = probes
    health.last_loop_at = clock.now
    clock.now += 29
    assert client.get("/livez").status_code == 200
    clock.now += 2
    stalled = client.get("/livez")
    assert stalled.status_code == 503 and stalled.json()["seconds_since_loop"] == 31
    assert client.get("/nope").status_code == 404


def test_a_stopped_port_refuses_probes_at_once():
    """A worker that left its loop still takes a while to exit: its probes are refused, not left hanging."""
    port = free_port()
    server = serve(port, WorkerMetrics("w", MODEL).registry, Health(), host="127.0.0.1")
    assert httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5).status_code == 503
    started = time.monotonic()
    stop_serving(server)
    assert time.monotonic() - started < 1
    with pytest.raises(httpx.ConnectError):  # a listening socket left open would time out here instead
        httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=3)
