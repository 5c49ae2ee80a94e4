"""Every process over TLS (mutual, with certificates the test makes) as an ACL user
restricted to kvfleet's and RQ's keys: the deployment guide's minimal ACL, checked for real."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import redis

from engine import EngineConfig, LLMEngine
from jobs import batches
from jobs.connection import connect
from producers.api import create_app
from producers.submit import main as submit
from tests.services import ThreadedUvicorn, free_port, make_tls_files
from tests.workers.helpers import MODEL, read_lines
from workers.worker import Worker, WorkerOptions

# The deployment guide's ACL for every kvfleet process, word for word.
KVFLEET_ACL = ("kvfleet on >s3cret-pass resetkeys ~kvfleet:* ~rq:* resetchannels &rq:* -@all +@read +@write "
               "+@stream +@scripting +@transaction +@connection +@pubsub -@dangerous +info +time +client|setname "
               "+client|getname")


@pytest.fixture
def tls_redis(tmp_path, monkeypatch):
    files = make_tls_files(tmp_path / "tls")
    port = free_port()
    process = subprocess.Popen([
        shutil.which("redis-server"), "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
        "--tls-cert-file", files["server_cert"], "--tls-key-file", files["server_key"],
        "--tls-ca-cert-file", files["ca_cert"], "--tls-auth-clients", "yes", "--save", "", "--appendonly", "no",
        "--dir", str(tmp_path), "--user", "default", "off", "--user", *KVFLEET_ACL.split()],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    monkeypatch.setenv("KVFLEET_REDIS_CA", files["ca_cert"])
    monkeypatch.setenv("KVFLEET_REDIS_CERT", files["client_cert"])
    monkeypatch.setenv("KVFLEET_REDIS_KEY", files["client_key"])
    url = f"rediss://kvfleet:s3cret-pass@127.0.0.1:{port}/0"
    deadline = time.monotonic() + 10
    while True:
        try:
            connect(url).ping()
            break
        except redis.ConnectionError:
            assert time.monotonic() < deadline and process.poll() is None, "redis-server with TLS did not start"
            time.sleep(0.05)
    yield url, files
    process.kill()
    process.wait(timeout=10)


def test_the_deployment_guide_documents_this_acl():
    readme = (Path(__file__).resolve().parents[2] / "docs" / "deployment.md").read_text()
    documented = next(line for line in readme.splitlines() if line.startswith("user kvfleet on"))
    assert documented == "user " + KVFLEET_ACL.replace(">s3cret-pass", ">PASSWORD")


def test_a_full_batch_over_tls_as_a_restricted_user(tls_redis, tiny_llama, tmp_path, capsys):
    url, files = tls_redis
    r = connect(url)
    with pytest.raises(redis.exceptions.NoPermissionError, match="no permissions to access one of the keys"):
        r.set("someone-else:key", 1)  # the ACL holds: only kvfleet's and RQ's keys
    with pytest.raises(redis.ConnectionError):  # no client certificate, no connection
        redis.Redis.from_url(url, ssl_ca_certs=files["ca_cert"]).ping()

    worker = Worker(LLMEngine(EngineConfig(model=tiny_llama, num_kv_blocks=64)), r,
                    WorkerOptions(name="tls-worker", served_model_names=[MODEL], block_ms=50, maintain_seconds=0.05))
    worker.run_once()  # heartbeat: submit sees a live worker
    source = tmp_path / "in.jsonl"
    source.write_text("".join(f'{{"custom_id": "c{i}", "prompt": "secure {i}", "max_tokens": 4}}\n' for i in range(8)))
    assert submit([str(source), "--redis-url", url, "--model", MODEL, "--require-worker"]) == 0
    batch_id = capsys.readouterr().out.split()[0]

    finalizer = subprocess.Popen([sys.executable, "-m", "workers.finalizer", "--redis-url", url,
                                  "--sweep-seconds", "0.5"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while batches.batch_object(r, batch_id)["status"] not in batches.TERMINAL:
            assert time.monotonic() < deadline and finalizer.poll() is None, finalizer.stdout.read1().decode()
            worker.run_once()
        with ThreadedUvicorn(create_app(url)) as api:
            batch = httpx.get(f"{api.url}/v1/batches/{batch_id}").json()
            models = httpx.get(f"{api.url}/v1/models").json()
    finally:
        finalizer.terminate()
        output = finalizer.communicate(timeout=20)[0].decode()
    assert batch["status"] == "completed", output
    assert batch["request_counts"] == {"total": 8, "completed": 8, "failed": 0}
    assert sorted(line["custom_id"] for line in read_lines(r, batch["output_file_id"])) == [f"c{i}" for i in range(8)]
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert "no permissions" not in output and "Traceback" not in output, output
