"""The console over plain HTTP: its key, its headers, file downloads, the refresh fragment,
a cross-origin cancel refused, and the numbers behind the progress columns."""

from __future__ import annotations

import time

import httpx
import pytest

from jobs import batches
from producers.api import create_app
from producers.live_stats import RateSampler, eta_seconds
from tests.console.conftest import API_KEY
from tests.services import ThreadedUvicorn
from tests.workers.helpers import completion, submit_lines


def test_the_console_is_behind_the_api_key(console_api, r):
    batch_id = submit_lines(r, [completion("a", "x")])
    with httpx.Client(base_url=console_api.url) as client:
        assert client.get("/ui").headers["location"] == "/ui/login"
        assert client.get(f"/ui/batches/{batch_id}").status_code == 303
        assert client.post("/ui/login", data={"key": "wrong"}).status_code == 401
        assert client.get("/ui", headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200
        logged_in = client.post("/ui/login", data={"key": API_KEY})
        cookie = logged_in.headers["set-cookie"].lower()
        assert logged_in.status_code == 303 and "httponly" in cookie and "samesite=strict" in cookie
        page = client.get("/ui")
        assert page.status_code == 200 and batch_id in page.text
        assert "script-src 'self'" in page.headers["content-security-policy"]
        fragment = client.get("/ui", headers={"X-Console-Fragment": "1"}).text
        assert fragment.lstrip().startswith('<div class="scroll"><table id="batches">') and "<header>" not in fragment
        assert client.post(f"/ui/batches/{batch_id}/cancel", headers={"Origin": "https://evil.example"}).status_code == 403
        assert batches.batch_object(r, batch_id)["status"] == "in_progress"
        assert client.post(f"/ui/batches/{batch_id}/cancel").status_code == 303
        assert batches.batch_object(r, batch_id)["status"] == "cancelling"
        input_file = batches.batch_object(r, batch_id)["input_file_id"]
        assert input_file is None  # submitted from a file on disk: nothing to download
        assert client.get("/ui/files/file-missing").status_code == 404
        client.post("/ui/logout")
        assert client.get("/ui").status_code == 303


def test_eta_comes_from_the_recent_completion_rate():
    now = [1000.0]
    sampler = RateSampler(window_seconds=60, clock=lambda: now[0])
    batch = {"id": "b", "status": "in_progress", "in_progress_at": 900.0,
             "request_counts": {"total": 1000, "completed": 100, "failed": 0}}
    assert sampler.rate(batch) == 1.0  # not watched for long yet: 100 done in 100 s since it started
    now[0] += 10
    batch["request_counts"]["completed"] = 150  # then 50 in 10 s
    assert sampler.rate(batch) == 5.0 and eta_seconds(batch, 5.0) == 170.0
    batch["status"] = "completed"
    assert eta_seconds(batch, None) == 0.0


def test_the_session_cookie_is_signed_expires_and_never_holds_the_key(console_api, r, monkeypatch):
    from producers.routes import console

    with httpx.Client(base_url=console_api.url) as client:
        token = client.post("/ui/login", data={"key": API_KEY}).cookies["kvfleet_console"]
        assert API_KEY not in token and client.get("/ui").status_code == 200
    for forged in (token[:-2] + "xx", API_KEY, ""):
        assert httpx.get(f"{console_api.url}/ui", cookies={"kvfleet_console": forged}).status_code == 303
    monkeypatch.setattr(console, "SESSION_SECONDS", 0)
    time.sleep(1.1)
    assert httpx.get(f"{console_api.url}/ui", cookies={"kvfleet_console": token}).status_code == 303  # expired
    monkeypatch.setattr(console, "SESSION_SECONDS", 3600)
    assert httpx.get(f"{console_api.url}/ui", cookies={"kvfleet_console": token}).status_code == 200
    monkeypatch.setenv("KVFLEET_API_KEY", "a-rotated-key")
    assert httpx.get(f"{console_api.url}/ui", cookies={"kvfleet_console": token}).status_code == 303  # void now


@pytest.mark.parametrize("trusted, is_https", [("127.0.0.1", True), ("10.9.9.9", False)])
def test_behind_a_tls_proxy_only_trusted_forwarded_headers_count(redis_server, r, monkeypatch, trusted, is_https):
    monkeypatch.setenv("KVFLEET_API_KEY", API_KEY)
    batch_id = submit_lines(r, [completion("a", "x")])
    proxy = {"X-Forwarded-Proto": "https", "X-Forwarded-For": "203.0.113.7", "Host": "kvfleet.example"}
    with ThreadedUvicorn(create_app(redis_server.url), proxy_headers=True, forwarded_allow_ips=trusted) as api, \
            httpx.Client(base_url=api.url, headers=proxy) as client:
        login = client.post("/ui/login", data={"key": API_KEY})
        assert ("secure" in login.headers["set-cookie"].lower()) is is_https
        client.cookies.set("kvfleet_console", login.cookies["kvfleet_console"])
        cancel = client.post(f"/ui/batches/{batch_id}/cancel", headers={"Origin": "https://kvfleet.example"})
        assert cancel.status_code == (303 if is_https else 403)  # the browser's https origin is this site's


def test_the_workers_page_shows_total_and_active_parameters(console_api, r):
    from jobs import heartbeats

    base = {"root": "m", "max_model_len": 512, "tensor_parallel_size": 1, "free_blocks": 10, "total_blocks": 16,
            "running": 0, "waiting": 0, "unstarted": 0, "unstarted_blocks_needed": 0, "preemptions": 0,
            "in_flight": 0, "draining": 0, "started_at": time.time(), "tokens_per_s": 0.0, "heartbeat_seconds": 1.0}
    heartbeats.record_heartbeat(r, "w-moe", {**base, "models": ["moe"], "num_params": 30_532_122_624,
                                            "num_active_params": 3_345_000_000}, 30)
    heartbeats.record_heartbeat(r, "w-dense", {**base, "models": ["dense"], "num_params": 134_515_008,
                                              "num_active_params": 134_515_008,
                                              "weights": "GGUF Q4_1/Q8_0 kept quantized, 98 MiB",
                                              "kv_cache_dtype": "fp8_e4m3"}, 30)
    with httpx.Client(base_url=console_api.url, headers={"Authorization": f"Bearer {API_KEY}"}) as client:
        page = client.get("/ui/workers").text
    moe_row = page[page.index("w-moe"):].split("</tr>")[0]
    dense_row = page[page.index("w-dense"):].split("</tr>")[0]
    assert "30.5B" in moe_row and "(3.35B active)" in moe_row
    assert "135M" in dense_row and "active" not in dense_row
    assert "GGUF Q4_1/Q8_0 kept quantized, 98 MiB" in dense_row and "kept quantized" not in moe_row
    assert "KV cache fp8_e4m3" in dense_row and "KV cache" not in moe_row


def test_the_workers_page_shows_a_tenant_only_its_own_adapters(console_api, r, monkeypatch):
    import json  # noqa: PLC0415

    from jobs import heartbeats, keys  # noqa: PLC0415

    monkeypatch.setenv("KVFLEET_API_KEYS", "key-of-acme=acme,key-of-globex=globex")
    secret = "s3://models/adapters/acme-merger-terms"
    heartbeats.record_heartbeat(r, "w1", {"models": ["base", secret], "root": "base", "free_blocks": 8,
                                          "total_blocks": 8, "lora_parents": {secret: ["base", secret]}}, 60)
    r.hset(keys.LORA_ADAPTERS, secret, json.dumps({"base": "base", "tenant": "acme", "used_at": time.time()}))

    def page(key: str) -> httpx.Response:
        return httpx.get(f"{console_api.url}/ui/workers", headers={"Authorization": f"Bearer {key}"})

    assert page("key-of-globex").status_code == 200 and "acme-merger-terms" not in page("key-of-globex").text
    assert "acme-merger-terms" in page("key-of-acme").text
    assert "acme-merger-terms" not in page(API_KEY).text  # tenant default's key, beside the tenants' keys
