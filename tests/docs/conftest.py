"""The session's fleets, started from the docs' own commands (tests/docs/fleets.py)."""

from __future__ import annotations

import pytest

from tests.docs.fleets import Fleets


@pytest.fixture(scope="session")
def fleets(tmp_path_factory):
    started = Fleets(tmp_path_factory.mktemp("fleets"))
    yield started
    for fleet in started.running.values():
        fleet.stop()
