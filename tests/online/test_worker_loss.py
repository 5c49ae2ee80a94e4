"""A worker killed with kill -9 while it holds an online request: another worker takes it
over and continues it from its checkpoint, unnoticed by the client, whose concatenated
deltas are exactly an uninterrupted run's text. Only a stream that sent tokens and lost its
checkpoint ends with an error event."""

from __future__ import annotations

import signal
import threading
import time

import openai
import pytest

from engine import SamplingParams
from jobs import keys
from producers.api import create_app
from tests.e2e.fleet import Fleet
from tests.services import ThreadedUvicorn

MODEL = "demo"
PROMPT = "Workers hold the queue's requests while"


@pytest.fixture
def fleet(demo_model, redis_server, r, tmp_path):
    fleet = Fleet(demo_model, redis_server.url, tmp_path)
    yield fleet
    fleet.stop()


@pytest.fixture
def client(redis_server, r, monkeypatch):
    monkeypatch.delenv("KVFLEET_API_KEY", raising=False)
    with ThreadedUvicorn(create_app(redis_server.url)) as api:
        yield openai.OpenAI(base_url=f"{api.url}/v1", api_key="unused", max_retries=0, timeout=60)


def start_worker(fleet: Fleet, name: str):
    process = fleet.start_worker(name, num_kv_blocks=256, lease_seconds=2, served_model_names=[MODEL])
    fleet.wait_ready(name)
    return process


def deliver_next_entry(r, consumer: str) -> None:
    """Wait for the next online entry and deliver it to `consumer` (XREADGROUP): the state a
    worker leaves when it dies between taking an entry and its first step."""
    stream = keys.online_stream(MODEL)
    deadline = time.monotonic() + 10
    while not r.xreadgroup(keys.CONSUMER_GROUP, consumer, {stream: ">"}, count=1):
        assert time.monotonic() < deadline, "no online entry arrived"
        time.sleep(0.01)


def test_killed_before_the_first_token_the_request_completes_on_another_worker(fleet, client, r, reference):
    first = start_worker(fleet, "first")
    chunks: list = []
    streaming = threading.Thread(target=lambda: chunks.extend(client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stream=True)))
    first.send_signal(signal.SIGSTOP)  # it takes nothing more
    time.sleep(0.2)  # a command it sent before it stopped has been answered
    streaming.start()
    deliver_next_entry(r, "first")
    [pending] = r.xpending_range(keys.online_stream(MODEL), keys.CONSUMER_GROUP, "-", "+", 10)
    assert pending["consumer"] == b"first"
    first.kill()  # kill -9: it never ran a step of the request
    first.wait(timeout=10)
    start_worker(fleet, "second")  # takes the entry over once its lease (2 s) has passed
    streaming.join(timeout=60)
    assert not streaming.is_alive()
    expected = reference.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    assert "".join(c.choices[0].text for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == "length"


def online_request_id(r) -> str:
    """The request id of the online stream's newest entry."""
    [(_, fields)] = r.xrevrange(keys.online_stream(MODEL), count=1)
    return fields[b"request_id"].decode()


def is_still_owed(r) -> bool:
    """Whether the newest request waits for another worker: its entry pending (the worker was
    killed holding it) or a copy of it not yet delivered (handed back). False when the worker
    finished it before it was stopped."""
    stream = keys.online_stream(MODEL)
    [group] = r.xinfo_groups(stream)
    [(newest_id, _)] = r.xrevrange(stream, count=1)
    return group["pending"] > 0 or group["last-delivered-id"] != newest_id


def stop_mid_generation(fleet, client, r, params: dict, stop: str) -> tuple:
    """Start a worker, read 24 of its streamed chunks, then stop it (kill -9, or SIGTERM with
    --drain-mode migrate). The tiny model makes the other 72 tokens in a blink, so a test
    process that lags behind it (two busy cores) can stop a worker that already finished: then
    that run is read to its end and the attempt repeated on a fresh worker and request, until
    one is stopped with its request unfinished. Returns the open stream and the chunks read."""
    for attempt in range(10):
        name = f"first-{attempt}"
        first = fleet.start_worker(name, num_kv_blocks=256, lease_seconds=2, served_model_names=[MODEL],
                                   extra=("--drain-mode", "migrate") if stop == "migrate" else ())
        fleet.wait_ready(name)
        stream = client.completions.create(**params)
        received = [next(stream) for _ in range(24)]  # some tokens out: stop it mid-generation
        if stop == "kill":
            first.kill()
        else:
            stopped_at = time.monotonic()
            first.send_signal(signal.SIGTERM)
            while r.xpending_range(keys.online_stream(MODEL), keys.CONSUMER_GROUP, "-", "+", 10,
                                   consumername=name) and time.monotonic() < stopped_at + 10:
                time.sleep(0.01)
            assert time.monotonic() - stopped_at < 2  # handed back at once, not left to a lease
        assert first.wait(timeout=10) == (-signal.SIGKILL if stop == "kill" else 0)
        if is_still_owed(r):
            return stream, received
        assert [c.choices[0].finish_reason for c in list(stream)[-1:]] == ["length"]  # it had finished
    raise AssertionError("every attempt finished before its worker was stopped")


@pytest.mark.parametrize(("stop", "lapses"), [("kill", None), ("kill", "reply stream"), ("migrate", None)])
def test_stopped_after_tokens_a_stream_continues_on_another_worker_without_repeats(fleet, client, r, reference,
                                                                                  stop, lapses):
    """kill -9, or SIGTERM with --drain-mode migrate (which hands the request back at once)."""
    params = dict(model=MODEL, prompt=PROMPT, max_tokens=96, temperature=0.8, seed=11, stream=True,
                  extra_body={"ignore_eos": True})
    stream, received = stop_mid_generation(fleet, client, r, params, stop)
    if lapses == "reply stream":  # its replacement comes after the reply stream expired: the checkpoint remains
        r.delete(keys.reply(online_request_id(r)))
    start_worker(fleet, "second")
    received += list(stream)  # no exception
    expected = reference.generate([PROMPT], SamplingParams(temperature=0.8, seed=11, max_tokens=96,
                                                           ignore_eos=True), use_tqdm=False)[0]
    assert "".join(c.choices[0].text for c in received) == expected.text
    assert [c.choices[0].finish_reason for c in received if c.choices[0].finish_reason] == ["length"]
    resumed = fleet.metric("second", "kvfleet:resumed_tokens_total")
    assert fleet.metric("second", "kvfleet:resumed_requests_total") == 1 and 0 < resumed < 96
    assert fleet.metric("second", "kvfleet:generation_tokens_total") == 96 - resumed  # sampled there only


def test_killed_after_tokens_a_stream_without_its_checkpoint_ends_with_an_error_event(fleet, client, r):
    first = start_worker(fleet, "first")
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1500, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    received = [next(stream)]
    assert received[0].choices[0].finish_reason is None
    first.kill()
    first.wait(timeout=10)
    r.delete(keys.checkpoint(online_request_id(r), "online"))  # lost: the rerun could not be checked
    start_worker(fleet, "second")
    with pytest.raises(openai.APIError) as raised:
        for chunk in stream:
            received.append(chunk)
    assert "stopped after streaming began" in raised.value.message
    assert all(c.choices[0].finish_reason is None for c in received)  # it never looked finished
    deadline = time.monotonic() + 10
    while r.xpending(keys.online_stream(MODEL), keys.CONSUMER_GROUP)["pending"]:  # settled, not run again
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert fleet.metric("second", "kvfleet:generation_tokens_total") == 0


def test_killed_after_tokens_a_non_streaming_request_is_continued_and_answered_whole(fleet, client, r, reference):
    first = start_worker(fleet, "first")
    answers: list = []
    waiting = threading.Thread(target=lambda: answers.append(client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=600, temperature=0, extra_body={"ignore_eos": True})))
    waiting.start()
    deadline = time.monotonic() + 30
    while not r.keys("kvfleet:reply:*") or not r.xlen(keys.reply(online_request_id(r))):  # tokens went out
        assert time.monotonic() < deadline, "the first worker sent no token"
        time.sleep(0.01)
    first.kill()
    first.wait(timeout=10)
    request_id = online_request_id(r)
    assert r.hget(keys.reply_attempts(request_id), "sent") == b"1"
    r.delete(keys.reply(request_id))  # the reply TTL lapses before a replacement comes
    start_worker(fleet, "second")
    waiting.join(timeout=120)
    assert not waiting.is_alive() and answers
    expected = reference.generate([PROMPT], SamplingParams(temperature=0, max_tokens=600, ignore_eos=True),
                                  use_tqdm=False)[0]
    assert answers[0].choices[0].text == expected.text  # one run's text, not the first attempt's joined to it
    assert answers[0].usage.completion_tokens == 600
    assert r.hget(keys.reply_attempts(request_id), "started") == b"2"
