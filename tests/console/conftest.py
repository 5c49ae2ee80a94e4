"""The console's fleet: the API under uvicorn and a worker loop in a thread on the tiny
Llama, a real redis-server, and headless Debian chromium driven by Selenium."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from engine import EngineConfig, LLMEngine
from producers.api import create_app
from producers.routes import console
from tests.online.conftest import WorkerThread
from tests.services import ThreadedUvicorn
from tests.workers.helpers import MODEL

API_KEY = "console-test-key"
SCREENSHOTS = Path(__file__).resolve().parents[2] / "out" / "console"


@pytest.fixture
def console_api(r, redis_server, monkeypatch):
    monkeypatch.setenv("KVFLEET_API_KEY", API_KEY)
    monkeypatch.setattr(console, "REFRESH_SECONDS", 1)  # the live sections refresh every second
    with ThreadedUvicorn(create_app(redis_server.url)) as server:
        yield server


@pytest.fixture
def console_worker(tiny_llama, redis_server, r, console_api):
    """A worker two requests wide (so a batch takes seconds), and the finalizer process."""
    engine = LLMEngine(EngineConfig(model=tiny_llama, num_kv_blocks=64, max_num_seqs=2))
    finalizer = subprocess.Popen([sys.executable, "-m", "workers.finalizer", "--redis-url", redis_server.url],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with WorkerThread(engine, redis_server.url, name="console-worker", served_model_names=[MODEL]) as worker:
            worker._heartbeat()
            yield worker
    finally:
        finalizer.kill()
        finalizer.wait(timeout=10)


@pytest.fixture
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    binary, driver = shutil.which("chromium"), shutil.which("chromedriver")
    assert binary and driver, "the console test needs Debian's chromium and chromium-driver (make system-deps)"
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                     "--window-size=1100,720"):
        options.add_argument(argument)
    chrome = webdriver.Chrome(service=Service(driver), options=options)
    chrome.set_page_load_timeout(30)
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    yield chrome
    chrome.quit()
