"""Real services for tests: a redis-server each test session starts itself (so
tests can kill and restart it) and moto's S3-compatible HTTP server."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import uvicorn

from jobs.finalize import run_queued_jobs as run_finalize_jobs  # noqa: F401 (re-exported for tests)
from jobs.local_redis import RedisServer, free_port  # noqa: F401 (re-exported for tests)


class S3Server:
    """moto's ThreadedMotoServer: a real S3-compatible HTTP endpoint."""

    def __init__(self, port: int | None = None) -> None:
        from moto.server import ThreadedMotoServer

        self.port = port or free_port()
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> S3Server:
        self.server.start()
        return self

    def stop(self) -> None:
        self.server.stop()


class ThreadedUvicorn:
    """An ASGI app served by uvicorn on a free port, in a thread of the test process."""

    def __init__(self, app, **config) -> None:
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    **config))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ThreadedUvicorn:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def s3_environment(endpoint_url: str) -> dict[str, str]:
    return {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
            "KVFLEET_S3_ENDPOINT_URL": endpoint_url}


def make_tls_files(folder: Path) -> dict[str, str]:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, as PEM files."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    folder.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)

    def issue(name: str, issuer_key, issuer_name, is_ca: bool, san=None):
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer_name or subject)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=is_ca, path_length=None), critical=True))
        if san:
            builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
        certificate = builder.sign(issuer_key or key, hashes.SHA256())
        return key, certificate

    ca_key, ca = issue("kvfleet-test-ca", None, None, True)
    files = {}
    for name, (key, certificate) in {
        "ca": (ca_key, ca),
        "server": issue("127.0.0.1", ca_key, ca.subject, False,
                        [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]),
        "client": issue("kvfleet-worker", ca_key, ca.subject, False),
    }.items():
        (folder / f"{name}.crt").write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
        (folder / f"{name}.key").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                               serialization.PrivateFormat.PKCS8,
                                                               serialization.NoEncryption()))
        files[f"{name}_cert"], files[f"{name}_key"] = str(folder / f"{name}.crt"), str(folder / f"{name}.key")
    return files


def descendants(pid: int) -> set[int]:
    """Every process below `pid`, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def is_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def start_serve(arguments: list[str], tmp_path, env: dict | None = None,
                timeout: float = 120) -> tuple[subprocess.Popen, int]:
    """`workers.serve` with `arguments` on a free port, once it prints its base URL; its log is
    tmp_path / "serve.log"."""
    port = free_port()
    env = env or {**os.environ, "OMP_NUM_THREADS": "1", "KVFLEET_REDIS_URL": ""}  # no Redis: it starts its own
    log = open(tmp_path / "serve.log", "w+")  # noqa: SIM115
    serve = subprocess.Popen([sys.executable, "-m", "workers.serve", *arguments, "--port", str(port),
                              "--drain-seconds", "5"], stdout=log, stderr=subprocess.STDOUT, env=env, text=True)
    deadline = time.monotonic() + timeout
    while f"http://127.0.0.1:{port}/v1" not in (tmp_path / "serve.log").read_text():
        if serve.poll() is not None or time.monotonic() > deadline:
            serve.kill()
            raise AssertionError((tmp_path / "serve.log").read_text())
        time.sleep(0.2)
    return serve, port
