"""The OpenAI-compatible API, driven by the official `openai` client."""

from __future__ import annotations

import json
import socket
import time

import httpx
import openai
import pytest

from jobs import batches, heartbeats, keys
from jobs.recording import record_result
from jobs.results import Choice, Usage, chat_completion_body, error_line, success_line
from jobs.schemas import parse_line
from jobs.storage import open_storage
from producers.api import create_app
from producers.routes.files import content_disposition
from tests.services import ThreadedUvicorn, run_finalize_jobs


@pytest.fixture
def api(r, redis_server, monkeypatch):
    monkeypatch.delenv("KVFLEET_API_KEY", raising=False)
    with ThreadedUvicorn(create_app(redis_server.url)) as server:
        yield server


def client_for(api, key="unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{api.url}/v1", api_key=key, max_retries=0)


def chat_lines(n: int) -> bytes:
    return "".join(json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
                               "body": {"model": "demo", "messages": [{"role": "user", "content": f"Q{i}"}],
                                        "max_tokens": 8}}) + "\n" for i in range(n)).encode()


def act_as_worker(r, batch_id: str, failed: set[str] = frozenset()) -> None:
    """Do what a worker does, through the contract's own functions: read the stream,
    record a chat.completion per request (an error line for those in `failed`), then let an
    RQ worker finalize."""
    stream = keys.batch_stream("demo", batch_id)
    storage = open_storage(batches.load_fields(r, batch_id)["sink"], r)
    for _, entries in r.xreadgroup(keys.CONSUMER_GROUP, "w1", {stream: ">"}, count=100):
        for entry_id, fields in entries:
            request = parse_line(fields[b"line"], int(fields[b"line_number"]))
            usage = Usage(prompt_tokens=4, completion_tokens=2)
            body = chat_completion_body("demo", [Choice(f"answer to {request.custom_id}", "stop")], usage)
            line = error_line(request.custom_id, "test_error", "failed on purpose") \
                if request.custom_id in failed else success_line(request.custom_id, body)
            record_result(r, storage, batch_id, line, usage, ack=(stream, keys.CONSUMER_GROUP, entry_id))
    assert run_finalize_jobs(r) == 1


def test_openai_client_full_flow(api, r):
    client = client_for(api)
    uploaded = client.files.create(file=("requests.jsonl", chat_lines(3)), purpose="batch")
    assert uploaded.purpose == "batch" and uploaded.bytes == len(chat_lines(3))
    assert client.files.retrieve(uploaded.id).filename == "requests.jsonl"
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h", metadata={"job": "nightly"})
    assert batch.status == "in_progress" and batch.request_counts.total == 3
    assert batch.metadata == {"job": "nightly"}
    assert client.batches.retrieve(batch.id).id == batch.id
    assert batch.id in [b.id for b in client.batches.list(limit=10).data]

    act_as_worker(r, batch.id)
    done = client.batches.retrieve(batch.id)
    assert done.status == "completed"
    assert done.request_counts.completed == 3 and done.request_counts.failed == 0
    assert done.usage.input_tokens == 12 and done.usage.output_tokens == 6
    lines = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
    assert sorted(line["custom_id"] for line in lines) == ["req-0", "req-1", "req-2"]
    for line in lines:
        assert line["error"] is None and line["response"]["status_code"] == 200
        body = line["response"]["body"]
        assert body["object"] == "chat.completion"
        assert body["choices"][0]["message"]["content"] == f"answer to {line['custom_id']}"
        assert body["usage"]["total_tokens"] == 6
    one = httpx.get(f"{api.url}/v1/batches/{batch.id}/results/req-1").json()
    assert one["custom_id"] == "req-1"


def test_cancel_and_list_pagination(api):
    client = client_for(api)
    ids = []
    for _ in range(3):
        uploaded = client.files.create(file=("r.jsonl", chat_lines(2)), purpose="batch")
        ids.append(client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                         completion_window="24h").id)
    cancelled = client.batches.cancel(ids[0])
    assert cancelled.status == "cancelling" and cancelled.cancelling_at is not None
    page = client.batches.list(limit=2)
    assert [b.id for b in page.data] == [ids[2], ids[1]] and page.has_more
    assert [b.id for b in client.batches.list(limit=2, after=ids[1]).data] == [ids[0]]
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(ids[0])  # already cancelling


def test_invalid_file_makes_a_failed_batch_with_line_errors(api):
    client = client_for(api)
    content = chat_lines(2) + b'{"custom_id": "bad", "prompt": 5}\n'
    uploaded = client.files.create(file=("r.jsonl", content), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    assert batch.status == "failed" and batch.failed_at is not None
    assert [(e.code, e.line, e.param) for e in batch.errors.data] == [("invalid_request", 3, "prompt")]


def test_errors_have_openai_shape_and_codes(api, r, monkeypatch):
    client = client_for(api)
    with pytest.raises(openai.NotFoundError) as missing:
        client.batches.retrieve("batch_nope")
    assert missing.value.body["code"] == "batch_not_found"
    with pytest.raises(openai.NotFoundError):
        client.files.content("file-nope")
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id="file-nope", endpoint="/v1/chat/completions", completion_window="24h")
    uploaded = client.files.create(file=("r.jsonl", chat_lines(1)), purpose="batch")
    with pytest.raises(openai.BadRequestError):
        client.batches.create(input_file_id=uploaded.id, endpoint="/v1/moderations", completion_window="24h")
    mismatched = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h")
    assert mismatched.status == "failed"  # OpenAI's way: the batch exists, with each line's error
    assert mismatched.errors.data[0].message == "must match the batch endpoint /v1/embeddings"
    assert mismatched.errors.data[0].param == "url" and mismatched.errors.data[0].line == 1
    response = httpx.post(f"{api.url}/v1/batches", json={"endpoint": "/v1/completions"})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "input_file_id"
    monkeypatch.setenv("KVFLEET_MAX_UPLOAD_BYTES", "10")
    with pytest.raises(openai.APIStatusError) as too_big:
        client.files.create(file=("r.jsonl", chat_lines(1)), purpose="batch")
    assert too_big.value.status_code == 413 and too_big.value.body["code"] == "file_too_large"
    assert r.keys(keys.file_content("*")) == [keys.file_content(uploaded.id).encode()]  # nothing partial kept
    # A declared size over the limit is refused before the body is read.
    monkeypatch.setenv("KVFLEET_MAX_UPLOAD_BYTES", str(1024))
    huge = httpx.post(f"{api.url}/v1/files", content=b"x" * 200_000,
                      headers={"content-type": "multipart/form-data; boundary=b"})
    assert huge.status_code == 413 and huge.json()["error"]["code"] == "file_too_large"


def test_cors_is_off_unless_origins_are_listed(r, redis_server, monkeypatch):
    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "GET"}
    monkeypatch.delenv("KVFLEET_CORS_ORIGINS", raising=False)
    with ThreadedUvicorn(create_app(redis_server.url)) as server:
        response = httpx.options(f"{server.url}/v1/batches", headers=preflight)
        assert "access-control-allow-origin" not in response.headers
        assert "access-control-allow-origin" not in httpx.get(f"{server.url}/v1/batches",
                                                              headers={"Origin": "https://app.example"}).headers
    monkeypatch.setenv("KVFLEET_CORS_ORIGINS", "https://app.example")
    with ThreadedUvicorn(create_app(redis_server.url)) as server:
        response = httpx.options(f"{server.url}/v1/batches", headers=preflight)
        assert response.headers["access-control-allow-origin"] == "https://app.example"


def test_api_key_is_required_when_set(api, monkeypatch):
    monkeypatch.setenv("KVFLEET_API_KEY", "sekret")
    with pytest.raises(openai.AuthenticationError):
        client_for(api, "wrong").batches.list()
    assert httpx.get(f"{api.url}/v1/batches").status_code == 401
    assert client_for(api, "sekret").batches.list().data == []
    assert httpx.get(f"{api.url}/healthz").json() == {"status": "ok"}  # the probe's route stays open
    assert httpx.get(f"{api.url}/metrics").status_code == 401  # tenant names: behind a key
    metrics = httpx.get(f"{api.url}/metrics", headers={"Authorization": "Bearer sekret"}).text
    assert 'kvfleet:api_requests_total{route="/v1/batches",status="401",tenant="none"}' in metrics


def test_models_lists_what_live_workers_serve_in_openais_shape(r, api):
    from jobs import heartbeats

    client = client_for(api)
    assert client.models.list().data == []
    heartbeats.record_heartbeat(r, "w1", {"models": ["/models/llama-3-8b", "llama"], "root": "/models/llama-3-8b",
                                          "max_model_len": 8192, "started_at": 1700000000}, 30)
    heartbeats.record_heartbeat(r, "w2", {"models": ["llama"], "root": "/models/llama-3-8b",
                                          "max_model_len": 8192, "started_at": 1700000000}, 30)
    models = client.models.list().data
    assert [m.id for m in models] == ["/models/llama-3-8b", "llama"]
    assert all(m.object == "model" and m.owned_by == "kvfleet" and m.created == 1700000000 for m in models)
    raw = httpx.get(f"{api.url}/v1/models").json()
    assert raw["object"] == "list" and raw["data"][1]["max_model_len"] == 8192
    assert client.models.retrieve("/models/llama-3-8b").id == "/models/llama-3-8b"
    with pytest.raises(openai.NotFoundError) as error:
        client.models.retrieve("nobody-serves-this")
    assert error.value.body["code"] == "model_not_found"
    r.delete(keys.worker("w1"))  # w1's heartbeat expired
    assert [m.id for m in client.models.list().data] == ["llama"]


def test_a_batch_output_outside_the_allow_list_is_a_400(api, r, tmp_path, monkeypatch):
    client = client_for(api)
    uploaded = client.files.create(file=("requests.jsonl", chat_lines(1)), purpose="batch")
    monkeypatch.delenv("KVFLEET_ALLOWED_OUTPUTS", raising=False)
    for output in ("file:///etc", "s3://someone-elses-bucket/x"):
        with pytest.raises(openai.BadRequestError) as raised:
            client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h", extra_body={"output": output})
        error = raised.value.body
        assert error["param"] == "output" and "is not an allowed destination" in error["message"]
    monkeypatch.setenv("KVFLEET_ALLOWED_OUTPUTS", f"file://{tmp_path}/results/")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h", extra_body={"output": f"file://{tmp_path}/results/t1"})
    assert batches.load_fields(r, batch.id)["sink"] == f"file://{tmp_path}/results/t1"
    assert len(r.zrange(keys.BATCHES, 0, -1)) == 1  # the refused ones created nothing


def test_a_retried_create_with_the_same_idempotency_key_makes_nothing_twice(api, r):
    client = client_for(api)
    first_file = client.files.create(file=("a.jsonl", chat_lines(2)), purpose="batch",
                                     extra_headers={"Idempotency-Key": "upload-1"})
    again = client.files.create(file=("a.jsonl", chat_lines(2)), purpose="batch",
                                extra_headers={"Idempotency-Key": "upload-1"})
    assert again.id == first_file.id and len(r.keys("kvfleet:file:{*}")) == 1
    create = dict(input_file_id=first_file.id, endpoint="/v1/chat/completions", completion_window="24h")
    first = client.batches.create(**create, extra_headers={"Idempotency-Key": "nightly-7"})
    retried = client.batches.create(**create, extra_headers={"Idempotency-Key": "nightly-7"})
    other = client.batches.create(**create, extra_headers={"Idempotency-Key": "nightly-8"})
    assert retried.id == first.id != other.id
    # two batches of two requests, not three
    assert r.xlen(keys.batch_stream("demo", first.id)) == r.xlen(keys.batch_stream("demo", other.id)) == 2
    assert r.zcard(keys.queues("demo")) == 2
    assert 0 < r.ttl(next(iter(r.keys("kvfleet:idempotency:*")))) <= 24 * 3600


def test_a_failed_create_forgets_its_idempotency_key(api, r):
    client = client_for(api)
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id="file-missing", endpoint="/v1/chat/completions",
                              completion_window="24h", extra_headers={"Idempotency-Key": "k"})
    uploaded = client.files.create(file=("a.jsonl", chat_lines(1)), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h", extra_headers={"Idempotency-Key": "k"})
    assert batch.status == "in_progress"


def test_a_claim_left_by_a_dead_api_frees_itself_and_a_slow_create_keeps_its_own(api, r, monkeypatch):
    """An API killed mid-create left its Idempotency-Key pending: the retry used to wait 30 s and
    get a 409 for a day. The claim now lapses within PENDING_TTL_SECONDS, and the retry makes
    the object; while a live create runs longer than that, it keeps renewing its claim, and a
    retry beside it waits for it and gets its object."""
    from concurrent.futures import ThreadPoolExecutor  # noqa: PLC0415

    from producers import idempotency  # noqa: PLC0415
    from producers.routes import files  # noqa: PLC0415

    monkeypatch.setattr(idempotency, "PENDING_TTL_SECONDS", 1)
    client = client_for(api)
    key = keys.idempotency("/v1/files", "upload-9", "default")
    r.set(key, idempotency.PENDING + b"of-a-dead-process", ex=idempotency.PENDING_TTL_SECONDS)
    started = time.monotonic()
    made = client.files.create(file=("a.jsonl", chat_lines(1)), purpose="batch",
                               extra_headers={"Idempotency-Key": "upload-9"})
    assert time.monotonic() - started < idempotency.WAIT_SECONDS and r.get(key) == made.id.encode()

    original = files.create_file
    slow = []

    def slow_create(*args, **kwargs):
        slow.append(True)
        time.sleep(4 * idempotency.PENDING_TTL_SECONDS)  # four TTLs: the claim must be renewed meanwhile
        return original(*args, **kwargs)

    monkeypatch.setattr(files, "create_file", slow_create)
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(client.files.create, file=("b.jsonl", chat_lines(1)), purpose="batch",
                            extra_headers={"Idempotency-Key": "upload-10"})
        while not slow:
            time.sleep(0.01)
        retried = pool.submit(client.files.create, file=("b.jsonl", chat_lines(1)), purpose="batch",
                              extra_headers={"Idempotency-Key": "upload-10"})
        assert retried.result().id == first.result().id
    assert len(slow) == 1  # one object made


def test_a_batch_for_a_model_no_worker_serves_says_so(api, r):
    client = client_for(api)
    uploaded = client.files.create(file=("a.jsonl", chat_lines(1)), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert "No live worker serves model 'demo'" in batch.model_extra["warnings"][0]
    heartbeats.record_heartbeat(r, "w1", {"models": ["demo"], "root": "demo", "max_model_len": 64}, 30)
    served = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert "warnings" not in served.model_extra


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_malformed_online_bodies_are_400s_never_500s(api, path):
    base = {"model": "demo", "prompt": "x"} if path == "/v1/completions" else {
        "model": "demo", "messages": [{"role": "user", "content": "x"}]}
    deep = {"type": "object"}
    for _ in range(150):
        deep = {"type": "object", "properties": {"a": deep}}
    bodies = [{**base, "structured_outputs": [None, None]}, {**base, "structured_outputs": "json"},
              {**base, "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": deep}}}]
    for body in bodies:
        answer = httpx.post(f"{api.url}{path}", json=body, timeout=30)
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["type"] == "invalid_request_error"
    messages = [answer.json()["error"]["message"] for answer in
                (httpx.post(f"{api.url}{path}", json=body, timeout=30) for body in bodies)]
    assert "structured_outputs: must be an object with exactly one of json" in messages[0]
    assert "the schema nests deeper than 64 levels" in messages[2]
    too_deep = httpx.post(f"{api.url}{path}", content=b"[" * 100_000 + b"]" * 100_000,
                          headers={"Content-Type": "application/json"}, timeout=30)
    assert too_deep.status_code == 400 and too_deep.json()["error"]["type"] == "invalid_request_error"


def test_files_are_listed_deleted_and_downloaded_under_any_name(api, r):
    client = client_for(api)
    names = ["a.jsonl", "résumé 📄.jsonl", "c.jsonl"]
    uploaded = [client.files.create(file=(name, chat_lines(1)), purpose="batch") for name in names]
    listed = client.files.list()
    assert [f.id for f in listed.data] == [f.id for f in reversed(uploaded)]  # newest first
    page = client.files.list(limit=1, after=uploaded[2].id)
    assert [f.id for f in page.data] == [uploaded[1].id] and page.has_more
    assert [f.id for f in client.files.list(order="asc", limit=2).data] == [uploaded[0].id, uploaded[1].id]
    assert client.files.list(purpose="batch_output").data == []
    content = httpx.get(f"{api.url}/v1/files/{uploaded[1].id}/content", timeout=10)
    assert content.status_code == 200 and content.content == chat_lines(1)
    disposition = content.headers["content-disposition"]
    assert disposition == "attachment; filename=\"r_sum_ _.jsonl\"; filename*=UTF-8''r%C3%A9sum%C3%A9%20%F0%9F%93%84.jsonl"
    assert content_disposition('a "b"\\c.jsonl') == \
        "attachment; filename=\"a _b__c.jsonl\"; filename*=UTF-8''a%20%22b%22%5Cc.jsonl"
    deleted = client.files.delete(uploaded[1].id)
    assert deleted.deleted and deleted.id == uploaded[1].id
    assert not r.exists(keys.file_content(uploaded[1].id)) and not r.exists(keys.file(uploaded[1].id))
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(uploaded[1].id)
    with pytest.raises(openai.NotFoundError):
        client.files.delete(uploaded[1].id)
    assert [f.id for f in client.files.list().data] == [uploaded[2].id, uploaded[0].id]


def test_deleting_an_output_file_removes_it_from_the_batch_s_sink(api, r, tmp_path, monkeypatch):
    monkeypatch.setenv("KVFLEET_ALLOWED_OUTPUTS", f"file://{tmp_path}/")
    client = client_for(api)
    uploaded = client.files.create(file=("in.jsonl", chat_lines(2)), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h", extra_body={"output": f"file://{tmp_path}/out"})
    act_as_worker(r, batch.id)
    output_id = client.batches.retrieve(batch.id).output_file_id
    assert [f.id for f in client.files.list(purpose="batch_output").data] == [output_id]
    stored = tmp_path / "out" / "files" / output_id
    assert stored.is_file()
    client.files.delete(output_id)
    assert not stored.exists()


def test_a_chunked_upload_is_stopped_at_the_limit_while_it_streams(api, r, monkeypatch):
    """No Content-Length: the 413 comes once the limit is passed, while the body is still coming,
    not after the multipart parser has taken it all."""
    limit = 256 * 1024
    monkeypatch.setenv("KVFLEET_MAX_UPLOAD_BYTES", str(limit))
    host, port = api.url.removeprefix("http://").split(":")

    def chunk(data: bytes) -> bytes:
        return b"%x\r\n" % len(data) + data + b"\r\n"

    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /v1/files HTTP/1.1\r\nHost: kvfleet\r\nTransfer-Encoding: chunked\r\n"
                     b"Content-Type: multipart/form-data; boundary=b\r\n\r\n")
        sock.sendall(chunk(b'--b\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
                           b'--b\r\nContent-Disposition: form-data; name="file"; filename="big.jsonl"\r\n\r\n'))
        for _ in range(2 * limit // (1 << 14)):  # twice the limit, and then the client waits: no last chunk
            sock.sendall(chunk(b"x" * (1 << 14)))
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            answer += sock.recv(65536)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413")
    assert json.loads(body.split(b"\r\n")[1] if b"chunked" in head else body)["error"]["code"] == "file_too_large"
    assert not r.keys(keys.file_content("*")) and not r.keys("kvfleet:file:*")


def test_healthz_says_a_status_and_no_internals_when_redis_is_gone(redis_server, monkeypatch):
    """A probe needs a status; what broke (host, port, errno) goes to the API's log only."""
    from tests.services import free_port  # noqa: PLC0415

    app = create_app(f"redis://127.0.0.1:{free_port()}/0")  # nothing listens there
    with ThreadedUvicorn(app) as server:
        response = httpx.get(f"{server.url}/healthz")
    assert response.status_code == 503 and response.json() == {"status": "unavailable"}
