"""The fleet of the end-to-end tests: worker and finalizer processes on the tiny Llama."""

from __future__ import annotations

import pytest

from tests.e2e.fleet import Fleet


@pytest.fixture
def fleet(tiny_llama, redis_server, r, tmp_path):
    fleet = Fleet(tiny_llama, redis_server.url, tmp_path)
    fleet.start_finalizer()
    yield fleet
    fleet.stop()
