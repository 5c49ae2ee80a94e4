"""A tenant's online tokens in flight (`max_inflight_tokens`, producers/token_waits.py): requests
past the quota wait in the API, not refused, until the tenant's requests free enough; one held
back at its timeout, or larger than the quota itself, gets a 429 naming it; waiting costs Redis
nothing and a release wakes the waiters. Driven by the official `openai` client and httpx."""

from __future__ import annotations

import contextlib
import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from jobs import heartbeats, keys, online, tenants
from jobs.tenants import estimated_tokens, inflight_tokens
from producers import token_waits
from producers.api import create_app
from tests.producers.test_api import client_for
from tests.services import ThreadedUvicorn


@pytest.fixture
def api(r, redis_server, monkeypatch, tmp_path):
    keys_file = tmp_path / "keys.json"
    keys_file.write_text(json.dumps({"key-of-globex": {"tenant": "globex", "max_inflight_tokens": 300}}))
    monkeypatch.setenv("KVFLEET_API_KEYS", f"@{keys_file}")
    with ThreadedUvicorn(create_app(redis_server.url)) as server:
        yield server


def test_a_tenants_online_tokens_in_flight_are_bounded_and_its_requests_wait(api, r, monkeypatch):
    """globex may hold 300 tokens (estimated: prompt at 4 characters a token + max_tokens).
    A request of 8 + 200 is in flight until it ends (here: a 504, no worker takes it); a second
    one waits beside it, not refused, and goes in once the first's tokens are free; one that
    is still held back at its timeout gets a 429 naming the quota, and one larger than the
    quota itself, which could never run, gets it at once."""
    heartbeats.record_heartbeat(r, "w1", {"models": ["demo"], "root": "demo", "max_model_len": 512}, 30)
    globex = client_for(api, "key-of-globex")

    def ask(max_tokens: int = 200):
        return globex.completions.create(model="demo", prompt="x" * 30, max_tokens=max_tokens)

    def in_flight() -> list[bytes]:
        return r.zrange(keys.tenant_inflight("globex"), 0, -1)

    with ThreadPoolExecutor(2) as pool:
        monkeypatch.setenv("KVFLEET_REQUEST_TIMEOUT", "2")
        first = pool.submit(ask)
        while not in_flight():
            time.sleep(0.02)
        [held_by_first] = in_flight()
        assert inflight_tokens(r, "globex") == 8 + 200
        monkeypatch.setenv("KVFLEET_REQUEST_TIMEOUT", "6")
        second = pool.submit(ask)
        time.sleep(0.5)
        assert not second.done() and in_flight() == [held_by_first]  # waiting, not refused
        with pytest.raises(openai.APIStatusError) as timed_out:
            first.result()
        assert timed_out.value.status_code == 504
        while in_flight() in ([], [held_by_first]):
            time.sleep(0.02)
        assert inflight_tokens(r, "globex") == 8 + 200  # the second went in
        monkeypatch.setenv("KVFLEET_REQUEST_TIMEOUT", "1")
        with pytest.raises(openai.RateLimitError) as held_back:
            ask()  # the second holds the quota past this one's timeout
        assert held_back.value.body["param"] == "max_inflight_tokens"
        assert "until this request's timeout" in held_back.value.body["message"]
        with pytest.raises(openai.APIStatusError) as its_turn:
            second.result()
        assert its_turn.value.status_code == 504
    assert inflight_tokens(r, "globex") == 0
    started = time.monotonic()
    with pytest.raises(openai.RateLimitError) as never:
        ask(max_tokens=400)  # 408 tokens against a quota of 300
    assert "can never run" in never.value.body["message"] and time.monotonic() - started < 1
    assert estimated_tokens("y" * 9, {"n": 2}) == 3 + 2 * 1024  # max_tokens unset: 1,024 a choice


def num_scripts_run(r) -> int:
    stats = r.info("commandstats")
    return sum(stats.get(name, {}).get("calls", 0) for name in ("cmdstat_eval", "cmdstat_evalsha"))


def test_held_back_requests_cost_nothing_once_their_clients_leave_and_wake_when_tokens_free(api, r, monkeypatch):
    """globex's first request holds 208 of its 300 tokens (no worker answers it). Twenty more
    are held back; their clients give up. Then no quota script runs at all (it ran ~18 a
    second per departed client when they polled). A waiter wakes when the first's tokens are
    freed, not at its next recheck."""
    heartbeats.record_heartbeat(r, "w1", {"models": ["demo"], "root": "demo", "max_model_len": 512}, 600)
    monkeypatch.setenv("KVFLEET_REQUEST_TIMEOUT", "120")
    body = {"model": "demo", "prompt": "x" * 30, "max_tokens": 200}
    headers = {"Authorization": "Bearer key-of-globex"}

    def ask(timeout: float) -> None:
        with contextlib.suppress(httpx.TimeoutException):
            httpx.post(f"{api.url}/v1/completions", json=body, headers=headers, timeout=timeout)

    with ThreadPoolExecutor(24) as pool:
        first = pool.submit(ask, 300)
        while not r.zrange(keys.tenant_inflight("globex"), 0, -1):
            time.sleep(0.02)
        for departed in [pool.submit(ask, 0.5) for _ in range(20)]:
            departed.result()  # each client gave up after half a second
        calls, quiet_since = num_scripts_run(r), time.monotonic()
        while time.monotonic() - quiet_since < 2 * token_waits.RECHECK_SECONDS:
            assert time.monotonic() - quiet_since < 30, "departed clients' requests still poll the quota"
            time.sleep(0.2)
            if num_scripts_run(r) != calls:  # one may still be between its last try and noticing
                calls, quiet_since = num_scripts_run(r), time.monotonic()
        monkeypatch.setattr(token_waits, "RECHECK_SECONDS", 600.0)  # only a release can wake it now
        waiting = pool.submit(ask, 300)
        while num_scripts_run(r) == calls:  # it tried once, and waits
            time.sleep(0.02)
        [held] = r.zrange(keys.tenant_inflight("globex"), 0, -1)
        request_id, tokens = held.decode().split()
        tenants.release_tokens(r, "globex", request_id, int(tokens))  # as the first's end does
        woken = time.monotonic()
        while not r.zrange(keys.tenant_inflight("globex"), 0, -1):
            assert time.monotonic() - woken < 60, "the waiter did not wake on the release"
            time.sleep(0.02)
        [now_held] = r.zrange(keys.tenant_inflight("globex"), 0, -1)
        for held_id in (request_id, now_held.decode().split()[0]):  # end both, as a worker would
            pipe = r.pipeline()
            online.publish(pipe, held_id, online.Error(503, "test_over", "done"))
            pipe.execute()
        first.result(), waiting.result()
