"""The worker's HTTP port: Prometheus metrics and the probes an orchestrator asks.

    GET /metrics   Prometheus text format
    GET /healthz   readiness: 200 once the model is loaded and the worker has joined its
                   consumer groups, while it is not draining; 503 before and after
    GET /livez     liveness: 200 while the worker loop keeps turning (or the model is still
                   loading); 503 once no loop iteration started for `stall_seconds`

Liveness follows the loop, not Redis: during a Redis outage the loop backs off and keeps
turning, and restarting the pod would not bring Redis back.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

DEFAULT_STALL_SECONDS = 120.0
SHUTDOWN_POLL_SECONDS = 0.1  # how often the serving thread looks for a shutdown request


class Health:
    """What the probes read; the worker writes it from its loop."""

    def __init__(self, stall_seconds: float = DEFAULT_STALL_SECONDS, clock=time.monotonic) -> None:
        self.stall_seconds, self.clock = stall_seconds, clock
        self.is_loaded = False  # the engine (model, KV cache) is up
        self.is_joined = False  # the consumer groups of every stream exist and the loop reads them
        self.is_draining = False
        self.last_loop_at: float | None = None  # monotonic start of the latest loop iteration

    def ready(self) -> tuple[bool, dict]:
        state = {"loaded": self.is_loaded, "joined": self.is_joined, "draining": self.is_draining}
        return self.is_loaded and self.is_joined and not self.is_draining, state

    def live(self) -> tuple[bool, dict]:
        if self.last_loop_at is None:
            return True, {"loop": "not started (loading)"}
        idle = self.clock() - self.last_loop_at
        return idle < self.stall_seconds, {"seconds_since_loop": round(idle, 3), "stall_seconds": self.stall_seconds}


def serve(port: int, registry: CollectorRegistry, health: Health, host: str = "0.0.0.0") -> ThreadingHTTPServer:
    """Serve /metrics, /healthz and /livez on a daemon thread."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                self._send(200, CONTENT_TYPE_LATEST, generate_latest(registry))
            elif path in ("/healthz", "/livez"):
                ok, state = health.ready() if path == "/healthz" else health.live()
                body = json.dumps({"status": "ok" if ok else "unavailable", **state}).encode()
                self._send(200 if ok else 503, "application/json", body)
            else:
                self._send(404, "text/plain", b"not found\n")

        def _send(self, status: int, content_type: str, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:  # probes every few seconds: not worth a log line
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": SHUTDOWN_POLL_SECONDS}, daemon=True,
                     name="metrics-http").start()
    return server


def stop_serving(server: ThreadingHTTPServer) -> None:
    """Close the port once the worker has left its loop. The interpreter takes a while to
    tear down after that; a probe arriving meanwhile would be accepted by the kernel and
    then wait for an answer that never comes. Closed, it is refused at once."""
    server.shutdown()  # returns within SHUTDOWN_POLL_SECONDS
    server.server_close()
