"""The operator console under /ui: batches, workers, dead letters and the online lane.

Server-rendered (Jinja2, autoescaped: custom ids and metadata are user input), no build
step; /ui/static/console.js refreshes each page's live section every few seconds and
asks before a cancel. Behind the API's key: with KVFLEET_API_KEY set, /ui/login trades the
key for an HttpOnly, SameSite=Strict cookie (a bearer header works too).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import time
from collections import deque
from pathlib import Path
from typing import Annotated, Any

import redis
from fastapi import APIRouter, Depends, FastAPI, Form, Request
from fastapi.responses import FileResponse, RedirectResponse, Response, StreamingResponse
from fastapi.templating import Jinja2Templates
from jinja2 import Environment, FileSystemLoader, select_autoescape

from jobs import batches, dead_letters, heartbeats
from jobs.files import FileNotFound, file_object, read_file, read_lines
from jobs.results import is_error_line
from jobs.storage import find_result, result_stores
from producers.online import OnlineStats
from producers.status import duration

HERE = Path(__file__).parent
COOKIE = "kvfleet_console"
REFRESH_SECONDS = 3
MAX_ERROR_LINES = 20
MAX_SCANNED_RESULTS = 5000  # looking for error lines of a batch that is still running
CANCELLABLE = ("validating", "in_progress")
SECURITY_HEADERS = {"Content-Security-Policy": "default-src 'self'; style-src 'self' 'unsafe-inline'; "
                                               "script-src 'self'; frame-ancestors 'none'",
                    "X-Content-Type-Options": "nosniff", "Referrer-Policy": "same-origin"}


class LoginRequired(Exception):
    pass


class RateSampler:
    """Each batch's recent completion rate, from the counts seen while the console is open."""

    def __init__(self, window_seconds: float = 60.0, clock=time.time) -> None:
        self.window_seconds, self.clock = window_seconds, clock
        self.samples: dict[str, deque[tuple[float, int]]] = {}

    def rate(self, batch: dict[str, Any]) -> float | None:
        """Requests/s over the last window (or since the batch started, until the console has
        watched it for a few seconds); None before it runs."""
        now, counts = self.clock(), batch["request_counts"]
        done = counts["completed"] + counts["failed"]
        samples = self.samples.setdefault(batch["id"], deque())
        samples.append((now, done))
        while len(samples) > 2 and now - samples[1][0] >= self.window_seconds:
            samples.popleft()
        start, done_then = samples[0]
        if now - start >= 5:
            return (done - done_then) / (now - start)
        started = batch.get("in_progress_at")
        return done / (now - started) if started and now > started else None


def eta_seconds(batch: dict[str, Any], rate: float | None) -> float | None:
    counts = batch["request_counts"]
    remaining = counts["total"] - counts["completed"] - counts["failed"]
    if batch["status"] in batches.TERMINAL or remaining <= 0:
        return 0.0
    return remaining / rate if rate else None


def first_errors(r: redis.Redis, batch: dict[str, Any], fields: dict[str, Any]) -> list[dict[str, Any]]:
    """The batch's first error lines: from its error file once finalized, else from its results."""
    lines: list[dict[str, Any]] = []
    if batch.get("error_file_id"):
        for line in read_lines(r, batch["error_file_id"]):
            if line.strip():
                lines.append(json.loads(line))
            if len(lines) >= MAX_ERROR_LINES:
                break
        return lines
    scanned = 0
    for store in result_stores(fields["sink"], r):
        for raw in store.iter_results(batch["id"]):
            scanned += 1
            line = json.loads(raw)
            if is_error_line(line):
                lines.append(line)
            if len(lines) >= MAX_ERROR_LINES or scanned >= MAX_SCANNED_RESULTS:
                return lines
    return lines


def add_console_routes(app: FastAPI, r: redis.Redis, online_stats: OnlineStats) -> None:
    environment = Environment(loader=FileSystemLoader(HERE / "templates"), autoescape=select_autoescape(default=True))
    environment.filters["duration"] = duration
    environment.filters["timestamp"] = lambda t: time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "—"
    templates = Jinja2Templates(env=environment)
    sampler = RateSampler()

    def require_login(request: Request) -> None:
        expected = os.environ.get("KVFLEET_API_KEY")
        if not expected:
            return
        token = request.cookies.get(COOKIE) or request.headers.get("authorization", "").removeprefix("Bearer ")
        if not secrets.compare_digest(token.encode(), expected.encode()):
            raise LoginRequired

    ui = APIRouter(prefix="/ui", dependencies=[Depends(require_login)], include_in_schema=False)

    @app.exception_handler(LoginRequired)
    async def _login(request: Request, _: LoginRequired):
        return RedirectResponse("/ui/login", status_code=303)

    def page(request: Request, name: str, **context) -> Response:
        """The whole page, or only its live section when console.js refreshes it."""
        fragment = request.headers.get("x-console-fragment") == "1"
        context.update(refresh_seconds=REFRESH_SECONDS, now=time.time(), path=request.url.path,
                       needs_login=bool(os.environ.get("KVFLEET_API_KEY")))
        response = templates.TemplateResponse(request, f"_{name}" if fragment else name, context)
        response.headers.update(SECURITY_HEADERS)
        return response

    @app.get("/ui/login", include_in_schema=False)
    def login_form(request: Request):
        return page(request, "login.html", error=None)

    @app.post("/ui/login", include_in_schema=False)
    def login(request: Request, key: Annotated[str, Form()]):
        expected = os.environ.get("KVFLEET_API_KEY", "")
        if not secrets.compare_digest(key.encode(), expected.encode()):
            response = page(request, "login.html", error="That key is not the API key.")
            response.status_code = 401
            return response
        response = RedirectResponse("/ui", status_code=303)
        response.set_cookie(COOKIE, key, httponly=True, samesite="strict", path="/ui",
                            secure=request.url.scheme == "https")
        return response

    @app.post("/ui/logout", include_in_schema=False)
    def logout():
        response = RedirectResponse("/ui/login", status_code=303)
        response.delete_cookie(COOKIE, path="/ui")
        return response

    @app.get("/ui/static/console.js", include_in_schema=False)
    def script():
        return FileResponse(HERE / "static" / "console.js", media_type="text/javascript")

    @ui.get("")
    @ui.get("/batches")
    def batch_list(request: Request, status: str | None = None, limit: int = 50):
        rows = []
        batch_ids = batches.list_batch_ids(r, limit=200 if status else min(limit, 200))
        for fields in batches.load_many(r, batch_ids):
            if fields is None or (status and fields["status"] != status):  # None: listed while being created
                continue
            batch = batches.as_openai(fields)
            rate = sampler.rate(batch)
            rows.append({"batch": batch, "rate": rate, "eta": eta_seconds(batch, rate)})
            if len(rows) >= limit:
                break
        statuses = ("validating", "in_progress", "finalizing", "completed", "failed", "expired", "cancelling",
                    "cancelled")
        return page(request, "batches.html", rows=rows, status=status, statuses=statuses)

    @ui.get("/batches/{batch_id}")
    def batch_page(request: Request, batch_id: str, custom_id: str | None = None):
        try:
            fields = batches.load_fields(r, batch_id)
        except batches.BatchNotFound:
            return page(request, "missing.html", what=f"batch {batch_id}")
        batch = batches.as_openai(fields)
        rate = sampler.rate(batch)
        raw = find_result(fields["sink"], r, batch_id, custom_id) if custom_id else None
        result = json.dumps(json.loads(raw), indent=2) if raw is not None else None
        files = {}
        for name in ("input_file_id", "output_file_id", "error_file_id"):
            try:
                files[name] = file_object(r, batch[name]) if batch.get(name) else None
            except FileNotFound:
                files[name] = None
        return page(request, "batch.html", batch=batch, sink=fields["sink"], rate=rate,
                    eta=eta_seconds(batch, rate), errors=first_errors(r, batch, fields), files=files,
                    custom_id=custom_id, result=result, cancellable=batch["status"] in CANCELLABLE)

    @ui.post("/batches/{batch_id}/cancel")
    def cancel(request: Request, batch_id: str):
        origin = request.headers.get("origin")
        if origin and origin.rstrip("/") != str(request.base_url).rstrip("/"):
            return Response("cross-origin request refused", status_code=403)
        with contextlib.suppress(batches.IllegalTransition, batches.BatchNotFound):
            batches.transition(r, batch_id, "cancelling")  # if it cannot, the page shows why: its status
        return RedirectResponse(f"/ui/batches/{batch_id}", status_code=303)

    @ui.get("/files/{file_id}")
    def download(file_id: str):
        try:
            info, chunks = file_object(r, file_id), read_file(r, file_id)
        except FileNotFound:
            return Response("no such file", status_code=404)
        filename = info["filename"].replace('"', "")
        return StreamingResponse(chunks, media_type="application/jsonl",
                                 headers={"Content-Disposition": f'attachment; filename="{filename}"'})

    @ui.get("/workers")
    def workers(request: Request):
        now = time.time()
        rows = []
        for worker in heartbeats.live_workers(r):
            age = now - worker["heartbeat"]
            total = worker.get("total_blocks") or 0
            rows.append({"worker": worker, "age": age, "is_stale": age > 3 * worker.get("heartbeat_seconds", 1.0) + 2,
                         "kv_usage": 1 - worker.get("free_blocks", 0) / total if total else 0.0})
        return page(request, "workers.html", rows=rows, online=online_stats.summary(),
                    models=sorted(heartbeats.served_models(r)))

    @ui.get("/dead-letters")
    def dead(request: Request):
        return page(request, "dead_letters.html", entries=dead_letters.latest(r, 100))

    app.include_router(ui)
