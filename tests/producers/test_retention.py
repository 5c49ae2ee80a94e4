"""Retention (jobs/retention.py): `expires_after` on uploads and `output_expires_after` on
batches in OpenAI's shapes and bounds, KVFLEET_DEFAULT_RETENTION, and the finalizer's sweep
deleting expired files, and a batch's results with its output, from Redis, folders and S3."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from jobs import files, keys, retention
from jobs.files import create_file, file_object
from jobs.storage import open_storage
from jobs.sweeper import Sweeper
from producers.api import create_app
from tests.producers.test_api import act_as_worker, chat_lines, client_for
from tests.services import ThreadedUvicorn

HOUR = 3600


@pytest.fixture
def api(r, redis_server, monkeypatch):
    for name in ("KVFLEET_API_KEY", "KVFLEET_API_KEYS", "KVFLEET_ADMIN_KEY", "KVFLEET_DEFAULT_RETENTION"):
        monkeypatch.delenv(name, raising=False)
    with ThreadedUvicorn(create_app(redis_server.url)) as server:
        yield server


def sweep_at(r, when: float) -> list[str]:
    sweeper = Sweeper(r, grace_seconds=60, wall_clock=lambda: when)
    sweeper.sweep()
    return [m.decode() for m in r.zrange(keys.EXPIRING_FILES, 0, -1)]


def test_an_upload_expires_when_it_asked_and_is_deleted_by_the_sweep(api, r):
    client = client_for(api)
    kept = client.files.create(file=("kept.jsonl", chat_lines(1)), purpose="batch")
    brief = client.files.create(file=("brief.jsonl", chat_lines(1)), purpose="batch",
                                expires_after={"anchor": "created_at", "seconds": HOUR})
    assert kept.expires_at is None and brief.expires_at == brief.created_at + HOUR
    assert sweep_at(r, brief.expires_at - 1) == [brief.id]  # not yet
    assert client.files.content(brief.id).read() == chat_lines(1)
    assert sweep_at(r, brief.expires_at + 1) == []
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(brief.id)
    assert not r.exists(keys.file(brief.id)) and not r.exists(keys.file_content(brief.id))  # the bytes too
    assert [f.id for f in client.files.list()] == [kept.id]


def test_a_file_past_its_expiry_is_gone_before_any_sweep(api, r):
    client = client_for(api)
    brief = client.files.create(file=("brief.jsonl", chat_lines(1)), purpose="batch",
                                expires_after={"anchor": "created_at", "seconds": HOUR})
    r.hset(keys.file(brief.id), "expires_at", int(time.time()) - 1)
    with pytest.raises(openai.NotFoundError):
        client.files.content(brief.id)
    with pytest.raises(openai.NotFoundError):  # and no batch may read it
        client.batches.create(input_file_id=brief.id, endpoint="/v1/chat/completions", completion_window="24h")


@pytest.mark.parametrize(("expires_after", "message"), [
    ({"anchor": "created_at", "seconds": 60}, "greater than or equal to 3600"),
    ({"anchor": "created_at", "seconds": 31 * 86400}, "less than or equal to 2592000"),
    ({"anchor": "last_active_at", "seconds": HOUR}, "Input should be 'created_at'"),
])
def test_expiries_outside_openais_bounds_are_refused(api, expires_after, message):
    with pytest.raises(openai.BadRequestError) as error:
        client_for(api).files.create(file=("a.jsonl", chat_lines(1)), purpose="batch", expires_after=expires_after)
    assert message in error.value.body["message"] and error.value.body["param"].startswith("expires_after")


def test_a_batchs_output_expires_with_its_results_and_its_input_stays(api, r):
    client = client_for(api)
    uploaded = client.files.create(file=("requests.jsonl", chat_lines(3)), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h",
                                  output_expires_after={"anchor": "created_at", "seconds": 2 * HOUR})
    act_as_worker(r, batch.id)
    done = client.batches.retrieve(batch.id)
    output = client.files.retrieve(done.output_file_id)
    assert output.expires_at == output.created_at + 2 * HOUR
    result = httpx.get(f"{api.url}/v1/batches/{batch.id}/results/req-1")
    assert result.status_code == 200
    sweep_at(r, output.expires_at + 1)
    with pytest.raises(openai.NotFoundError):
        client.files.content(done.output_file_id)
    assert httpx.get(f"{api.url}/v1/batches/{batch.id}/results/req-1").status_code == 404  # the results went too
    assert client.files.content(uploaded.id).read() == chat_lines(3)  # the input had no expiry
    with pytest.raises(openai.BadRequestError, match="output_expires_after.seconds"):
        client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h",
                              output_expires_after={"anchor": "created_at", "seconds": 10})


def test_the_operators_default_retention_applies_where_none_is_asked(api, monkeypatch):
    monkeypatch.setenv("KVFLEET_DEFAULT_RETENTION", str(7 * 86400))
    client = client_for(api)
    default = client.files.create(file=("a.jsonl", chat_lines(1)), purpose="batch")
    own = client.files.create(file=("b.jsonl", chat_lines(1)), purpose="batch",
                              expires_after={"anchor": "created_at", "seconds": HOUR})
    assert default.expires_at == default.created_at + 7 * 86400 and own.expires_at == own.created_at + HOUR
    with pytest.raises(ValueError, match="KVFLEET_DEFAULT_RETENTION: must be a positive number"):
        retention.default_retention({"KVFLEET_DEFAULT_RETENTION": "a week"})


@pytest.mark.parametrize("kind", ["folder", "s3"])
def test_an_expired_output_file_takes_its_batchs_results_from_folders_and_buckets(r, kind, tmp_path, request):
    sink = f"file://{tmp_path}" if kind == "folder" else f"s3://{request.getfixturevalue('s3_bucket')}/out"
    storage = open_storage(sink, r)
    lines = [b'{"custom_id": "req-%d"}' % i for i in range(3)]
    for i, line in enumerate(lines):
        storage.put_result("batch_abc", f"req-{i}", line)
    storage.put_result("batch_other", "req-0", b"{}")
    output = create_file(r, storage, [b"\n".join(lines) + b"\n"], "batch_abc_output.jsonl", "batch_output",
                         expires_after=HOUR, batch_id="batch_abc")
    assert len(list(storage.iter_results("batch_abc"))) == 3
    files.delete_expired(r, now=output["expires_at"] + 1)
    assert list(storage.iter_results("batch_abc")) == [] and storage.get_result("batch_abc", "req-0") is None
    assert list(storage.iter_results("batch_other")) == [b"{}"]  # another batch's stay
    with pytest.raises(KeyError):
        file_object(r, output["id"])


def test_deleting_a_batchs_output_file_deletes_the_results_behind_it(api, r):
    """DELETE /v1/files/{output_file_id} said deleted: true while the batch's results route still
    served each line, prompt answer and all. The error file's lines stay until it goes too."""
    client = client_for(api)
    uploaded = client.files.create(file=("requests.jsonl", chat_lines(3)), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    act_as_worker(r, batch.id, failed={"req-2"})
    done = client.batches.retrieve(batch.id)
    assert done.output_file_id and done.error_file_id

    def result(custom_id: str) -> int:
        return httpx.get(f"{api.url}/v1/batches/{batch.id}/results/{custom_id}").status_code

    assert [result(f"req-{i}") for i in range(3)] == [200, 200, 200]
    assert client.files.delete(done.output_file_id).deleted
    assert [result(f"req-{i}") for i in range(3)] == [404, 404, 200]
    assert client.files.delete(done.error_file_id).deleted
    assert result("req-2") == 404 and r.hlen(keys.batch_results(batch.id)) == 0


def test_an_ended_batch_and_its_keys_go_at_the_end_of_its_retention(api, r, monkeypatch):
    monkeypatch.setenv("KVFLEET_BATCH_RETENTION", str(2 * HOUR))
    client = client_for(api)
    uploaded = client.files.create(file=("requests.jsonl", chat_lines(2)), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    act_as_worker(r, batch.id)
    done = client.batches.retrieve(batch.id)
    ended_at = done.completed_at
    batch_keys = [keys.batch(batch.id), keys.partition_done(batch.id, 0), keys.partition_counts(batch.id, 0),
                  keys.batch_results(batch.id)]
    assert all(r.exists(key) for key in batch_keys)
    sweep_at(r, ended_at + HOUR)  # within its retention: kept
    assert client.batches.retrieve(batch.id).status == "completed"
    sweep_at(r, ended_at + 2 * HOUR + 60)
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve(batch.id)
    assert not any(r.exists(key) for key in batch_keys)
    assert client.batches.list().data == [] and r.zcard(keys.ENDED_BATCHES) == 0
    assert client.files.retrieve(done.output_file_id).id == done.output_file_id  # files keep their own expiry


def test_dead_letters_are_trimmed_past_their_retention(r, monkeypatch):
    monkeypatch.setenv("KVFLEET_DEAD_LETTER_RETENTION", str(HOUR))
    stream = keys.dead_letters(keys.batch_stream("demo", "batch_x"))
    now = time.time()
    r.xadd(stream, {"line": "an old prompt"}, id=f"{int((now - 2 * HOUR) * 1000)}-0")
    r.xadd(stream, {"line": "a recent prompt"}, id=f"{int((now - 60) * 1000)}-0")
    sweep_at(r, now)
    assert [fields[b"line"] for _, fields in r.xrange(stream)] == [b"a recent prompt"]
    with pytest.raises(ValueError, match="KVFLEET_DEAD_LETTER_RETENTION: must be a positive number"):
        retention.dead_letter_retention({"KVFLEET_DEAD_LETTER_RETENTION": "-1"})
