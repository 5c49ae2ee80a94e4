"""Tenants (jobs/tenants.py): each API key's team sees only its own files and batches, on
every route and in the console, the admin key sees all, and a tenant's queued-lines quota
is a 429 that names it. Driven by the official `openai` client."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest

from jobs import batches, dead_letters, keys, tenants
from jobs.online import OnlineEntry
from jobs.tenants import (
    ADMIN_TENANT,
    DEFAULT_TENANT,
    KeyConfigError,
    Tenant,
    key_ring_from_env,
)
from producers.api import create_app
from producers.routes import console
from tests.producers.test_api import act_as_worker, chat_lines, client_for
from tests.services import ThreadedUvicorn

ADMIN = "key-of-the-operator"
METRICS_KEY = "key-of-prometheus-and-keda"


@pytest.fixture
def api(r, redis_server, monkeypatch, tmp_path):
    keys_file = tmp_path / "keys.json"
    keys_file.write_text(json.dumps({"key-of-acme": {"tenant": "acme", "weight": 2},
                                     "key-of-initech": {"tenant": "initech", "max_open_batches": 2},
                                     "key-of-globex": {"tenant": "globex", "max_queued_lines": 5,
                                                       "max_inflight_tokens": 300}}))
    monkeypatch.setenv("KVFLEET_API_KEYS", f"@{keys_file}")
    monkeypatch.setenv("KVFLEET_ADMIN_KEY", ADMIN)
    monkeypatch.setenv("KVFLEET_API_KEY", "key-of-the-default-team")
    monkeypatch.setenv("KVFLEET_METRICS_KEY", METRICS_KEY)
    with ThreadedUvicorn(create_app(redis_server.url)) as server:
        yield server


def create_batch(client: openai.OpenAI, num_lines: int = 2, **options):
    uploaded = client.files.create(file=("requests.jsonl", chat_lines(num_lines)), purpose="batch", **options)
    return uploaded, client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                           completion_window="24h")


def test_a_tenant_never_reaches_another_tenants_files_or_batches(api, r):
    acme, globex, admin = client_for(api, "key-of-acme"), client_for(api, "key-of-globex"), client_for(api, ADMIN)
    file, batch = create_batch(acme)
    act_as_worker(r, batch.id)
    done = acme.batches.retrieve(batch.id)
    assert done.status == "completed" and done.output_file_id
    for attempt in (lambda: globex.files.retrieve(file.id), lambda: globex.files.content(file.id),
                    lambda: globex.files.delete(file.id), lambda: globex.files.retrieve(done.output_file_id),
                    lambda: globex.files.content(done.output_file_id), lambda: globex.batches.retrieve(batch.id),
                    lambda: globex.batches.cancel(batch.id),
                    lambda: globex.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions",
                                                  completion_window="24h")):
        with pytest.raises(openai.NotFoundError):  # 404, as if absent: ids cannot be probed
            attempt()
    result = httpx.get(f"{api.url}/v1/batches/{batch.id}/results/req-0", headers={"Authorization": "Bearer key-of-globex"})
    assert result.status_code == 404 and result.json()["error"]["code"] == "batch_not_found"
    assert globex.files.list().data == [] and globex.batches.list().data == []
    globex_file, globex_batch = create_batch(globex)
    assert {f.id for f in acme.files.list()} == {file.id, done.output_file_id}  # its output file is its own
    assert [b.id for b in acme.batches.list()] == [batch.id]
    assert {f.id for f in admin.files.list()} == {file.id, done.output_file_id, globex_file.id}
    assert [b.id for b in admin.batches.list()] == [globex_batch.id, batch.id]
    assert admin.files.content(file.id).read() == chat_lines(2)  # the admin reaches everything
    assert batches.load_fields(r, batch.id)["tenant"] == "acme" and r.hget(keys.file(file.id), "tenant") == b"acme"
    assert acme.files.delete(file.id).deleted and admin.files.retrieve(globex_file.id).id == globex_file.id


def test_an_idempotency_key_is_each_tenants_own(api):
    acme, globex = client_for(api, "key-of-acme"), client_for(api, "key-of-globex")
    same = {"extra_headers": {"Idempotency-Key": "nightly-run-1"}}
    first, again = (acme.files.create(file=("a.jsonl", chat_lines(1)), purpose="batch", **same) for _ in range(2))
    other = globex.files.create(file=("a.jsonl", chat_lines(1)), purpose="batch", **same)
    assert first.id == again.id and other.id != first.id
    assert globex.files.retrieve(other.id).id == other.id


def test_a_tenant_over_its_queued_lines_gets_a_429_naming_the_quota(api, r):
    globex = client_for(api, "key-of-globex")  # max_queued_lines 5
    create_batch(globex, num_lines=4)
    with pytest.raises(openai.RateLimitError) as error:
        create_batch(globex, num_lines=2)
    assert error.value.status_code == 429
    assert error.value.body["code"] == "quota_exceeded" and error.value.body["param"] == "max_queued_lines"
    assert "4 batch lines queued" in error.value.body["message"]
    assert len(globex.batches.list().data) == 1  # nothing was created
    create_batch(client_for(api, "key-of-acme"), num_lines=9)  # another tenant's lines are its own
    create_batch(globex, num_lines=1)  # within the quota still


def test_a_tenant_at_its_max_open_batches_gets_a_429_naming_it_until_one_ends(api, r):
    initech = client_for(api, "key-of-initech")
    _, first = create_batch(initech, num_lines=1)
    create_batch(initech, num_lines=1)
    with pytest.raises(openai.RateLimitError) as refused:
        create_batch(initech, num_lines=1)
    assert refused.value.body["code"] == "quota_exceeded" and refused.value.body["param"] == "max_open_batches"
    assert "2 batches open" in refused.value.body["message"] and len(initech.batches.list().data) == 2
    create_batch(client_for(api, "key-of-acme"), num_lines=1)  # the quota is initech's alone
    act_as_worker(r, first.id)  # one ends
    assert initech.batches.retrieve(first.id).status == "completed"
    create_batch(initech, num_lines=1)


def test_the_admin_is_no_team_the_default_key_reads_nothing_it_makes_and_shares_no_idempotency_key(api, r):
    """With KVFLEET_API_KEY (tenant `default`, as the Kubernetes manifest requires) beside the
    admin key, the admin's files and batches are its own, and so are its Idempotency-Keys."""
    admin, default = client_for(api, ADMIN), client_for(api, "key-of-the-default-team")
    same = {"extra_headers": {"Idempotency-Key": "nightly"}}
    file, batch = create_batch(admin)
    mine = default.files.create(file=("a.jsonl", chat_lines(1)), purpose="batch", **same)
    theirs = admin.files.create(file=("a.jsonl", chat_lines(1)), purpose="batch", **same)
    assert mine.id != theirs.id
    for attempt in (lambda: default.files.retrieve(file.id), lambda: default.batches.retrieve(batch.id),
                    lambda: default.files.content(theirs.id)):
        with pytest.raises(openai.NotFoundError):
            attempt()
    assert [f.id for f in default.files.list()] == [mine.id] and default.batches.list().data == []
    assert batches.load_fields(r, batch.id)["tenant"] == ADMIN_TENANT
    assert admin.files.retrieve(mine.id).id == mine.id  # the admin still reaches everyone's
    with pytest.raises(KeyConfigError, match="'admin' is reserved"):
        tenants.parse_keys("key-of-someone=admin")


def test_keys_are_checked_and_the_single_key_is_the_default_tenant(api):
    assert client_for(api, "key-of-the-default-team").batches.list().data == []
    with pytest.raises(openai.AuthenticationError):
        client_for(api, "no-such-key").batches.list()
    metrics = httpx.get(f"{api.url}/metrics", headers={"Authorization": f"Bearer {METRICS_KEY}"}).text
    assert 'kvfleet:api_requests_total{route="/v1/batches",status="200",tenant="default"} 1.0' in metrics
    assert 'kvfleet:api_requests_total{route="/v1/batches",status="401",tenant="none"} 1.0' in metrics


def test_the_console_shows_a_tenant_its_own_work_and_the_admin_everyones(api, r):
    acme, globex = client_for(api, "key-of-acme"), client_for(api, "key-of-globex")
    acme_file, acme_batch = create_batch(acme)
    _, globex_batch = create_batch(globex)
    dead_letters_entry = {b"line": b"{}"}
    r.xadd(keys.dead_letters(keys.batch_stream("demo", acme_batch.id)), dead_letters_entry)

    def get(path: str, key: str) -> httpx.Response:
        return httpx.get(f"{api.url}{path}", headers={"Authorization": f"Bearer {key}"})

    page = get("/ui", "key-of-globex").text
    assert globex_batch.id in page and acme_batch.id not in page and "tenant globex" in page
    assert "not found" in get(f"/ui/batches/{acme_batch.id}", "key-of-globex").text.lower()
    assert get(f"/ui/files/{acme_file.id}", "key-of-globex").status_code == 404
    assert "admin key" in get("/ui/dead-letters", "key-of-globex").text
    admin_page = get("/ui", ADMIN).text
    assert acme_batch.id in admin_page and globex_batch.id in admin_page
    assert '<td class="tenant">acme</td>' in admin_page and '<td class="tenant">globex</td>' in admin_page
    # The admin sees each tenant's share of the fleet now (acme weighs 2, globex 1), its queue and deadlines.
    tenants_table = admin_page[admin_page.index('id="tenants"'):admin_page.index("</table>")]
    acme_row = tenants_table[tenants_table.index('data-tenant="acme"'):tenants_table.index('data-tenant="globex"')]
    assert '<td class="share">67%</td>' in acme_row and "<td>2</td>" in acme_row and "in 24.0h" in acme_row
    assert '<td class="share">33%</td>' in tenants_table[tenants_table.index('data-tenant="globex"'):]
    assert 'id="tenants"' not in page  # a tenant sees no one else's
    assert get(f"/ui/files/{acme_file.id}", ADMIN).status_code == 200
    assert dead_letters.latest(r, 10) and "admin key" not in get("/ui/dead-letters", ADMIN).text
    login = httpx.post(f"{api.url}/ui/login", data={"key": "key-of-acme"}, follow_redirects=False)
    assert login.status_code == 303
    with httpx.Client(base_url=api.url, cookies=login.cookies) as session:  # the cookie names acme's key
        page = session.get("/ui").text
        assert acme_batch.id in page and globex_batch.id not in page


def test_key_specs_parse_and_bad_ones_name_their_entry(tmp_path):
    ring = key_ring_from_env({"KVFLEET_API_KEYS": "key-of-acme=acme:2.5, key-of-globex=globex"})
    assert ring.caller("key-of-acme").tenant == Tenant("acme", weight=2.5)
    assert not ring.caller("key-of-globex").is_admin and ring.caller("key-of-globex").tenant.weight == 1.0
    assert ring.caller("key-of-initech") is None
    assert key_ring_from_env({}).caller("anything").is_admin  # no keys: one open team
    alone = key_ring_from_env({"KVFLEET_API_KEY": "the-one-key"}).caller("the-one-key")
    assert alone.is_admin and alone.tenant.name == DEFAULT_TENANT  # as before tenants
    beside = key_ring_from_env({"KVFLEET_API_KEY": "the-one-key", "KVFLEET_ADMIN_KEY": "the-admin"})
    assert not beside.caller("the-one-key").is_admin and beside.caller("the-admin").is_admin
    bad = {"key-of-acme=": "entry #1: tenant must be", "key-of-acme=acme:zero": "entry #1: weight must be",
           "key-of-acme=acme,oops": "entry #2: expected KEY=TENANT", "short=acme": "at least 8 characters",
           "key-of-acme=ac me": "tenant must be"}
    for spec, message in bad.items():
        with pytest.raises(KeyConfigError, match=message):
            key_ring_from_env({"KVFLEET_API_KEYS": spec})
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"key-of-acme": {"tenant": "acme", "max_queued_lines": -1}}))
    with pytest.raises(KeyConfigError, match="key #1: max_queued_lines must be a positive number"):
        key_ring_from_env({"KVFLEET_API_KEYS": f"@{path}"})
    path.write_text(json.dumps({"key-of-acme": {"tenant": "acme", "quota": 1}}))
    with pytest.raises(KeyConfigError, match="unknown field 'quota'"):
        key_ring_from_env({"KVFLEET_API_KEYS": f"@{path}"})


def test_an_online_entry_carries_its_tenant():
    entry = OnlineEntry("req-1", "/v1/completions", {"prompt": "hi"}, False, 0, 1.0, 0.5, tenant="acme")
    fields = {k.encode(): v.encode() for k, v in entry.to_fields().items()}
    assert OnlineEntry.from_fields(fields).tenant == "acme"
    del fields[b"tenant"]  # an entry from before tenants
    assert OnlineEntry.from_fields(fields).tenant == DEFAULT_TENANT


def test_the_api_publishes_the_weights_and_the_queue_backlog_for_scaling(api, r):
    assert tenants.weights(r) == {"acme": 2.0, "globex": 1.0, "initech": 1.0, DEFAULT_TENANT: 1.0,  # fair share
                                  ADMIN_TENANT: 1.0}
    acme = client_for(api, "key-of-acme")
    create_batch(acme, num_lines=3)
    create_batch(client_for(api, "key-of-globex"), num_lines=2)
    monitor = {"Authorization": f"Bearer {METRICS_KEY}"}  # KEDA's metrics-api trigger sends it (bearer)
    backlog = httpx.get(f"{api.url}/queue/demo", headers=monitor)
    assert backlog.status_code == 200
    assert backlog.json() == {"model": "demo", "lag": 5, "pending": 0, "queues": 2}
    assert httpx.get(f"{api.url}/queue/nobody-serves-this", headers=monitor).json()["lag"] == 0


@pytest.mark.parametrize("path", ["/metrics", "/queue/demo"])
def test_routes_that_name_tenants_or_models_need_the_metrics_key(api, r, path):
    create_batch(client_for(api, "key-of-acme"), num_lines=1)  # a tenant's name in the counters
    for key in (None, "key-of-acme", "key-of-the-default-team", "no-such-key"):
        response = httpx.get(f"{api.url}{path}", headers={"Authorization": f"Bearer {key}"} if key else {})
        assert response.status_code == 401 and "acme" not in response.text
        assert response.json()["error"]["code"] == "invalid_api_key"
    for key in (METRICS_KEY, ADMIN):
        assert httpx.get(f"{api.url}{path}", headers={"Authorization": f"Bearer {key}"}).status_code == 200
    health = httpx.get(f"{api.url}/healthz")
    assert health.json() == {"status": "ok"}  # a probe's route stays open, and says a status only


# Every route the API's OpenAPI schema lists, and every console page, is checked below: a
# route with one of these path parameters gets another tenant's ids and must answer 404.
OBJECT_PARAMS = {"file_id", "batch_id", "custom_id"}
LIST_ROUTES = {("GET", "/v1/files"), ("GET", "/v1/batches")}  # must list none of another tenant's
REFERENCE_ROUTES = {("POST", "/v1/batches")}  # name another tenant's file in the body: 404
# Routes that reach no tenant's object, and what they expose instead. A new route that is none
# of the above fails the test until it is classified here.
NO_OBJECT_ROUTES = {
    ("POST", "/v1/completions"): "answers the caller's own request",
    ("POST", "/v1/chat/completions"): "answers the caller's own request",
    ("POST", "/v1/embeddings"): "answers the caller's own request",
    ("POST", "/v1/responses"): "answers the caller's own request (responses are not stored)",
    ("GET", "/v1/models"): "the fleet's models",
    ("GET", "/v1/models/{model}"): "one of the fleet's models",
    ("POST", "/v1/files"): "makes the caller's own file",
    ("GET", "/healthz"): "whether Redis answers",
    ("GET", "/metrics"): "counters, labelled by tenant name at most (KVFLEET_METRICS_KEY)",
    ("GET", "/queue/{model}"): "a model's backlog counts (KVFLEET_METRICS_KEY)",
}


def urls_for(path: str, ids: dict[str, list[str]]) -> list[str]:
    """The path with every combination of the given ids for its parameters."""
    found = [path]
    for name in re.findall(r"{(\w+)}", path):
        found = [url.replace(f"{{{name}}}", value) for url in found for value in ids[name]]
    return found


def test_no_route_in_the_schema_and_no_console_page_reaches_another_tenants_objects(api, r):
    acme = client_for(api, "key-of-acme")
    upload = acme.files.create(file=("acme-only.jsonl", chat_lines(2)), purpose="batch")
    done = acme.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
    act_as_worker(r, done.id)
    output_file_id = acme.batches.retrieve(done.id).output_file_id
    _, running = create_batch(acme)
    ids = {"file_id": [upload.id, output_file_id], "batch_id": [done.id, running.id], "custom_id": ["req-0"]}
    markers = [upload.id, output_file_id, done.id, running.id, "acme-only.jsonl", "answer to req-"]
    globex = httpx.Client(base_url=api.url, headers={"Authorization": "Bearer key-of-globex"})
    schema = httpx.get(f"{api.url}/openapi.json").json()
    for path, operations in schema["paths"].items():
        for method in operations:
            route, params = (method.upper(), path), set(re.findall(r"{(\w+)}", path))
            if params & OBJECT_PARAMS:
                assert params <= OBJECT_PARAMS, f"{route}: a path parameter this test does not know"
                for url in urls_for(path, ids):
                    response = globex.request(method, url)
                    assert response.status_code == 404, (route, url, response.text)
            elif route in REFERENCE_ROUTES:
                response = globex.post(path, json={"input_file_id": upload.id, "endpoint": "/v1/chat/completions",
                                                   "completion_window": "24h"})
                assert response.status_code == 404, (route, response.text)
            elif route in LIST_ROUTES:
                text = globex.get(path).text
                assert not [m for m in markers if m in text], route
            else:
                assert route in NO_OBJECT_ROUTES, f"{route} is new: classify what it exposes in this test"
    for console_route in console.router.routes:  # the pages, with the ids of another tenant
        for method in console_route.methods - {"HEAD"}:
            for url in urls_for(console_route.path, ids):
                response = globex.request(method, url, headers={"Origin": api.url})
                text = response.text
                leaked = [m for m in markers[4:] if m in text]  # an id may be echoed in "not found"
                assert not leaked and (response.status_code in (303, 404) or "not found" in text.lower()
                                       or not [m for m in markers if m in text]), (method, url, text[:300])
                if method == "GET" and set(re.findall(r"{(\w+)}", console_route.path)) & OBJECT_PARAMS:
                    assert response.status_code == 404, (url, response.status_code)  # as the API answers
    assert acme.batches.retrieve(running.id).status == "in_progress"  # the cancels did nothing
    assert acme.files.retrieve(upload.id).id == upload.id and acme.files.retrieve(output_file_id)  # nor the deletes
