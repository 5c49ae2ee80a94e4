"""The API reads nothing large before it knows the caller: a /v1 request without a valid key
is answered 401 before its body is read, every route's body stops at its limit (413 in
OpenAI's shape, before reading when the length is declared), and a request's text is bounded
as a whole."""

from __future__ import annotations

import json
import socket

import httpx
import pytest

from producers.api import create_app
from tests.services import ThreadedUvicorn

KEY = "key-of-the-one-team"
DECLARED = 30 * 1024 * 1024  # what the headers announce; the test sends only the first kilobyte


@pytest.fixture
def api(r, redis_server, monkeypatch):
    monkeypatch.setenv("KVFLEET_API_KEY", KEY)
    monkeypatch.setenv("KVFLEET_MAX_REQUEST_BYTES", str(1024 * 1024))
    with ThreadedUvicorn(create_app(redis_server.url)) as server:
        yield server


def answer_to_a_partly_sent_body(api, path: str, headers: dict[str, str]) -> tuple[int, dict]:
    """Send the headers of a 30 MB JSON body and its first kilobyte only: an API that reads
    the body first never answers (the socket times out); one that checks first answers now."""
    with socket.create_connection(("127.0.0.1", api.port), timeout=30) as sock:
        head = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json",
                f"Content-Length: {DECLARED}", *(f"{k}: {v}" for k, v in headers.items()), "", ""]
        sock.sendall("\r\n".join(head).encode() + b'{"model": "demo", "messages": [' + b" " * 1024)
        reply = b""
        while b"\r\n\r\n" not in reply or len(reply.split(b"\r\n\r\n", 1)[1]) < int(
                reply.lower().split(b"content-length: ", 1)[1].split(b"\r\n", 1)[0] if b"content-length: "
                in reply.lower() else 1 << 30):
            chunk = sock.recv(65536)
            if not chunk:
                break
            reply += chunk
    status = int(reply.split(b" ", 2)[1])
    return status, json.loads(reply.split(b"\r\n\r\n", 1)[1])


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/batches",
                                  "/v1/files"])
def test_no_key_is_a_401_before_the_body_is_read(api, path):
    status, body = answer_to_a_partly_sent_body(api, path, {})
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    status, body = answer_to_a_partly_sent_body(api, path, {"Authorization": "Bearer wrong-key-x"})
    assert status == 401 and body["error"]["type"] == "authentication_error"


def test_a_declared_body_over_the_limit_is_a_413_before_it_is_read(api):
    status, body = answer_to_a_partly_sent_body(api, "/v1/chat/completions", {"Authorization": f"Bearer {KEY}"})
    assert status == 413 and body["error"]["code"] == "request_too_large"
    assert "KVFLEET_MAX_REQUEST_BYTES" in body["error"]["message"]


def test_a_streamed_body_over_the_limit_is_cut_off_with_a_413(api):
    def chunks():
        yield b'{"model": "demo", "messages": [{"role": "user", "content": "'
        for _ in range(40):
            yield b"x" * 65536  # 2.5 MB in all, no Content-Length (chunked)
        yield b'"}]}'

    response = httpx.post(f"{api.url}/v1/chat/completions", content=chunks(), timeout=30,
                          headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"
    assert "KVFLEET_MAX_REQUEST_BYTES" in response.json()["error"]["message"]


def test_a_body_within_the_limit_is_still_checked_as_a_whole(api):
    messages = [{"role": "user", "content": "y" * 700_000}, {"role": "user", "content": "z" * 400_001}]
    response = httpx.post(f"{api.url}/v1/chat/completions", timeout=30, headers={"Authorization": f"Bearer {KEY}"},
                          json={"model": "demo", "messages": messages})
    assert response.status_code == 413  # 1,100,001 characters: more than 1 MiB of JSON
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVFLEET_MAX_REQUEST_BYTES", str(4 * 1024 * 1024))
        response = httpx.post(f"{api.url}/v1/chat/completions", timeout=30,
                              headers={"Authorization": f"Bearer {KEY}"}, json={"model": "demo", "messages": messages})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "messages"
    assert "1100001 characters together" in response.json()["error"]["message"]


def test_a_json_schema_of_megabytes_is_refused_naming_its_size(api):
    schema = {"type": "object", "properties": {"a": {"type": "string", "description": "d" * 300_000}}}
    response = httpx.post(f"{api.url}/v1/chat/completions", timeout=30, headers={"Authorization": f"Bearer {KEY}"},
                          json={"model": "demo", "messages": [{"role": "user", "content": "hi"}],
                                "response_format": {"type": "json_schema", "json_schema": {"name": "s",
                                                                                           "schema": schema}}})
    assert response.status_code == 400
    assert "more than 100000 characters of text" in response.json()["error"]["message"]


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "top_k": 2**64}, "top_k"),
    ("/v1/completions", {"prompt": "a", "seed": 2**64}, "seed"),
    ("/v1/completions", {"prompt": [1, 2**64]}, "prompt"),
    ("/v1/embeddings", {"input": "a", "dimensions": 2**64}, "dimensions"),
])
def test_a_number_no_engine_can_take_is_a_400_naming_its_field(api, path, body, param):
    response = httpx.post(f"{api.url}{path}", timeout=30, headers={"Authorization": f"Bearer {KEY}"},
                          json={"model": "demo", **body})
    assert response.status_code == 400 and response.json()["error"]["param"] == param
