"""An online fleet in the test process: the API under uvicorn and a worker loop in a
thread, on the demo model and a real redis-server."""

from __future__ import annotations

import threading

import openai
import pytest

from engine import LLM, EngineConfig, LLMEngine
from jobs.connection import connect
from producers.api import create_app
from tests.services import ThreadedUvicorn
from workers.worker import Worker, WorkerOptions

MODEL = "demo"


@pytest.fixture(scope="session")
def online_engine(demo_model) -> LLMEngine:
    return LLMEngine(EngineConfig(model=demo_model, num_kv_blocks=256, max_num_seqs=8))


@pytest.fixture(scope="session")
def reference(demo_model) -> LLM:
    """The offline engine the online answers are compared with."""
    return LLM(demo_model, num_kv_blocks=256, max_num_seqs=8)


class WorkerThread:
    def __init__(self, engine: LLMEngine, redis_url: str, **options) -> None:
        defaults = dict(name="online-worker", served_model_names=[MODEL], lease_seconds=5, block_ms=100,
                        maintain_seconds=0.1)
        self.worker = Worker(engine, connect(redis_url), WorkerOptions(**{**defaults, **options}))
        self.thread = threading.Thread(target=self.worker.work, daemon=True)

    def __enter__(self) -> Worker:
        self.thread.start()
        return self.worker

    def __exit__(self, *exc) -> None:
        self.worker.request_stop()
        self.thread.join(timeout=30)
        assert not self.thread.is_alive(), "the worker did not stop"


@pytest.fixture
def api(r, redis_server, monkeypatch):
    monkeypatch.delenv("KVFLEET_API_KEY", raising=False)
    with ThreadedUvicorn(create_app(redis_server.url)) as server:
        yield server


@pytest.fixture
def worker(online_engine, redis_server, r, api):
    assert not online_engine.has_unfinished()
    with WorkerThread(online_engine, redis_server.url) as running:
        running._heartbeat()  # registered before the first request: the API checks for live workers
        yield running
    assert not online_engine.has_unfinished()


@pytest.fixture
def client(api) -> openai.OpenAI:
    # A timeout well under openai's 600 s default: a worker thread that died fails the test, not the suite's clock.
    return openai.OpenAI(base_url=f"{api.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture
def async_client(api) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{api.url}/v1", api_key="unused", max_retries=0, timeout=120)
