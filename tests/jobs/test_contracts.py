"""The typed contracts producers and workers share: the batch stream entry (jobs/entries.py)
and the online reply events (jobs/online.py), through a real Redis."""

from __future__ import annotations

import json
import time

import pytest

from jobs import keys, online
from jobs.entries import BATCH_ENTRY_FIELDS, REQUEUES_FIELD, BatchEntry, MalformedEntry
from jobs.online import ChoiceDelta, Delta, Done, Error


def test_a_batch_entry_survives_a_stream_round_trip(r):
    entry = BatchEntry("batch_1", "c-7", 7, b'{"prompt": "caf\xc3\xa9"}', 1_700_000_000.25)
    entry_id = r.xadd(keys.batch_stream("m", "b"), entry.to_fields())
    [(read_id, fields)] = r.xrange(keys.batch_stream("m", "b"))
    assert read_id == entry_id and BatchEntry.from_fields(fields) == entry
    assert tuple(k.decode() for k in fields) == BATCH_ENTRY_FIELDS  # no requeues field on a fresh entry


def test_a_handed_back_copy_counts_its_requeues(r):
    entry = BatchEntry("batch_1", "c", 1, b"{}", None, requeues=3)
    r.xadd(keys.batch_stream("m", "b"), entry.to_fields())
    [(_, fields)] = r.xrange(keys.batch_stream("m", "b"))
    assert fields[REQUEUES_FIELD.encode()] == b"3" and BatchEntry.from_fields(fields) == entry


@pytest.mark.parametrize("fields, reason", [
    ({b"batch_id": b"b", b"custom_id": b"c", b"line": b"{}"}, "'line_number'"),
    ({b"batch_id": b"b", b"custom_id": b"c", b"line_number": b"x", b"line": b"{}"}, "invalid literal"),
    ({b"batch_id": b"\xff", b"custom_id": b"c", b"line_number": b"1", b"line": b"{}"}, "UnicodeDecodeError"),
])
def test_a_malformed_batch_entry_is_named(fields, reason):
    with pytest.raises(MalformedEntry, match=reason):
        BatchEntry.from_fields(fields)


EVENTS = [
    Delta([ChoiceDelta(0, "Hel", None, {"tokens": ["Hel"], "token_logprobs": [-0.5], "top_logprobs": [{}],
                                        "text_offset": [0]}),
           ChoiceDelta(1, "lo", "length", None, token_ids=[42, 7])], attempt=1),
    Done({"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}, attempt=2),
    Error(504, "request_timeout", "The request timed out.", attempt=3),
]


def test_reply_events_are_read_back_as_written_and_in_order(r):
    pipe = r.pipeline()
    for event in EVENTS:
        online.publish(pipe, "req-1", event)
    pipe.execute()
    last_id, events = online.decode_events(r.xread({keys.reply("req-1"): "0-0"}))
    assert events == EVENTS
    assert last_id == r.xrevrange(keys.reply("req-1"), count=1)[0][0].decode()
    assert 0 < r.ttl(keys.reply("req-1")) <= online.REPLY_TTL_SECONDS


def test_the_wire_format_of_reply_events():
    assert [json.loads(online.encode_event(e))["type"] for e in EVENTS] == ["delta", "done", "error"]
    assert [json.loads(online.encode_event(e))["attempt"] for e in EVENTS] == [1, 2, 3]
    delta = json.loads(online.encode_event(EVENTS[0]))
    assert "token_ids" not in delta["choices"][0] and delta["choices"][1]["token_ids"] == [42, 7]
    assert [e.is_last for e in EVENTS] == [False, True, True]


def test_an_unknown_event_type_is_an_error_not_a_guess():
    with pytest.raises(KeyError):
        online.decode_event('{"type": "surprise"}')


def test_the_attempt_record_outlives_the_reply_stream_and_counts_every_start(r):
    entry = online.OnlineEntry("req-2", "/v1/completions", {}, True, 0, deadline=time.time() + 600,
                               enqueued_at=time.time())
    first = online.start_attempt(r, entry)
    assert (first.number, first.is_cancelled, first.has_sent_tokens) == (1, False, False)
    pipe = r.pipeline()
    online.queue_tokens_sent(pipe, "req-2")
    online.publish(pipe, "req-2", Delta([ChoiceDelta(0, "a")], attempt=1))
    pipe.execute()
    r.delete(keys.reply("req-2"))  # the reply stream's TTL lapsed while no worker ran it
    online.cancel(r, "req-2")
    second = online.start_attempt(r, entry)
    assert (second.number, second.is_cancelled, second.has_sent_tokens) == (2, True, True)
    assert 600 < r.ttl(keys.reply_attempts("req-2")) <= 600 + online.ATTEMPTS_GRACE_SECONDS
