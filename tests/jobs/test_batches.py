"""Batch state machine in Redis: legal transitions succeed, illegal ones change nothing."""

import pytest

from jobs import batches, keys


def make(r, batch_id="batch_1"):
    assert batches.create_batch(r, batch_id, endpoint="/v1/completions", model="m", input_file_id=None,
                                completion_window="24h", sink="redis", metadata={"team": "ops"})
    return batch_id


def test_create_is_idempotent_and_shaped_like_openai(r):
    batch_id = make(r)
    assert not batches.create_batch(r, batch_id, endpoint="/v1/chat/completions", model="other",
                                    input_file_id=None, completion_window="1h", sink="redis")
    obj = batches.batch_object(r, batch_id)
    assert obj["object"] == "batch" and obj["status"] == "validating"
    assert obj["endpoint"] == "/v1/completions" and obj["model"] == "m"
    assert obj["expires_at"] - obj["created_at"] == 24 * 3600
    assert obj["request_counts"] == {"total": 0, "completed": 0, "failed": 0}
    assert obj["metadata"] == {"team": "ops"}
    assert obj["in_progress_at"] is None and obj["output_file_id"] is None


@pytest.mark.parametrize("path", [
    ["in_progress", "finalizing", "completed"],
    ["in_progress", "cancelling", "cancelled"],
    ["cancelling", "cancelled"],
    ["in_progress", "expired"],
    ["failed"],
    ["in_progress", "finalizing", "failed"],
])
def test_legal_paths(r, path):
    batch_id = make(r)
    previous = "validating"
    for status in path:
        assert batches.transition(r, batch_id, status) == previous
        previous = status
        obj = batches.batch_object(r, batch_id)
        assert obj["status"] == status
        assert obj[batches.TIMESTAMP_FIELDS[status]] is not None


@pytest.mark.parametrize("path, illegal", [
    ([], "completed"), ([], "finalizing"), (["in_progress"], "in_progress"), (["in_progress"], "cancelled"),
    (["in_progress", "finalizing", "completed"], "cancelling"), (["failed"], "in_progress"),
    (["in_progress", "expired"], "finalizing"), (["cancelling", "cancelled"], "completed"),
])
def test_illegal_transitions_are_refused_and_change_nothing(r, path, illegal):
    batch_id = make(r)
    for status in path:
        batches.transition(r, batch_id, status)
    before = r.hgetall(keys.batch(batch_id))
    with pytest.raises(batches.IllegalTransition, match=f"to {illegal}"):
        batches.transition(r, batch_id, illegal)
    assert r.hgetall(keys.batch(batch_id)) == before


def test_unknown_batch(r):
    with pytest.raises(batches.BatchNotFound):
        batches.transition(r, "batch_missing", "in_progress")


def test_listing_is_newest_first_with_cursor(r):
    for i in range(5):
        batches.create_batch(r, f"b{i}", endpoint="/v1/completions", model="m", input_file_id=None,
                             completion_window="24h", sink="redis")
        r.zadd(keys.BATCHES, {f"b{i}": 1000 + i})
    assert batches.list_batch_ids(r, limit=2) == ["b4", "b3"]
    assert batches.list_batch_ids(r, after="b3", limit=10) == ["b2", "b1", "b0"]


def test_completion_window_parsing():
    assert batches.parse_window("24h") == 86400
    assert batches.parse_window("90m") == 5400
    with pytest.raises(ValueError, match="completion_window"):
        batches.parse_window("soon")
