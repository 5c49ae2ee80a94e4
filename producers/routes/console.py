"""The operator console under /ui: batches, workers, dead letters and the online lane.

Server-rendered (Jinja2, autoescaped: custom ids and metadata are user input), no build
step; /ui/static/console.js refreshes each page's live section every few seconds and
asks before a cancel. Behind the API's keys (jobs/tenants.py): with keys set, /ui/login
trades a key for a session cookie (HttpOnly, SameSite=Strict, Secure over HTTPS), a bearer
header works too. The cookie holds no key: it is a token naming the key's SHA-256, signed with
a secret derived from every configured key (itsdangerous), good for SESSION_SECONDS, and void
once the keys change. A tenant sees its own batches and files only (another's are "not
found"); the admin key sees every tenant's, with their names, and the dead letters.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from pathlib import Path
from typing import Annotated, Any

import redis
from fastapi import APIRouter, Depends, Form, Request
from fastapi.responses import FileResponse, RedirectResponse, Response, StreamingResponse
from fastapi.templating import Jinja2Templates
from itsdangerous import BadSignature, URLSafeTimedSerializer
from jinja2 import Environment, FileSystemLoader, select_autoescape

from jobs import adapters, batches, dead_letters, heartbeats, outlook
from jobs.files import FileNotFound, file_object, owned_file, read_file, read_lines
from jobs.results import is_error_line
from jobs.storage import find_result, result_stores
from jobs.tenants import DEFAULT_TENANT, OPEN, Caller, KeyRing, key_hash, key_ring_from_env
from producers.dependencies import RedisDep, ServicesDep
from producers.live_stats import eta_seconds
from producers.routes.files import content_disposition
from producers.status import duration

HERE = Path(__file__).resolve().parents[1]
COOKIE = "kvfleet_console"
SESSION_SECONDS = 12 * 3600
REFRESH_SECONDS = 3
MAX_ERROR_LINES = 20
MAX_SCANNED_RESULTS = 5000  # looking for error lines of a batch that is still running
CANCELLABLE = ("validating", "in_progress")
STATUSES = ("validating", "in_progress", "finalizing", "completed", "failed", "expired", "cancelling", "cancelled")
SECURITY_HEADERS = {"Content-Security-Policy": "default-src 'self'; style-src 'self' 'unsafe-inline'; "
                                               "script-src 'self'; frame-ancestors 'none'",
                    "X-Content-Type-Options": "nosniff", "Referrer-Policy": "same-origin"}

_environment = Environment(loader=FileSystemLoader(HERE / "templates"), autoescape=select_autoescape(default=True))
_environment.filters["duration"] = duration
_environment.filters["count"] = lambda n: short_count(n)
_environment.filters["timestamp"] = lambda t: time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "—"
templates = Jinja2Templates(env=_environment)


class LoginRequired(Exception):
    pass


async def to_login(request: Request, _: LoginRequired) -> RedirectResponse:
    return RedirectResponse("/ui/login", status_code=303)



def short_count(number: int) -> str:
    """30532122624 -> '30.5B', 134515008 -> '135M': a parameter count as model names give it."""
    for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if number >= scale:
            return f"{number / scale:.3g}{unit}"
    return str(number)

def sessions(ring: KeyRing) -> URLSafeTimedSerializer:
    """Signs console sessions with a secret derived from the configured keys, never a key."""
    secret = hashlib.sha256(b"kvfleet-console-session\n" + b"".join(sorted(ring.by_hash))).hexdigest()
    return URLSafeTimedSerializer(secret, salt="kvfleet-console")


def session_caller(token: str, ring: KeyRing) -> Caller | None:
    try:
        session = sessions(ring).loads(token, max_age=SESSION_SECONDS)
    except BadSignature:  # forged, expired, or signed under other keys
        return None
    return ring.by_hash.get(bytes.fromhex(session.get("key", ""))) if isinstance(session, dict) else None


def require_login(request: Request) -> Caller:
    """The console's caller: from its session cookie or a bearer key (everyone, with no keys)."""
    ring = key_ring_from_env()
    cookie = request.cookies.get(COOKIE)
    bearer = request.headers.get("authorization", "").removeprefix("Bearer ")
    caller = OPEN if ring.is_open else (cookie and session_caller(cookie, ring)) or (bearer and ring.caller(bearer))
    if not caller:
        raise LoginRequired
    request.state.caller = caller
    request.state.tenant = caller.tenant.name
    return caller


ConsoleCaller = Annotated[Caller, Depends(require_login)]
public = APIRouter(prefix="/ui", include_in_schema=False)  # the login page and the script
router = APIRouter(prefix="/ui", dependencies=[Depends(require_login)], include_in_schema=False)


def page(request: Request, name: str, status_code: int = 200, **context) -> Response:
    """The whole page, or only its live section when console.js refreshes it."""
    fragment = request.headers.get("x-console-fragment") == "1"
    context.update(refresh_seconds=REFRESH_SECONDS, now=time.time(), path=request.url.path,
                   needs_login=not key_ring_from_env().is_open, caller=getattr(request.state, "caller", None))
    response = templates.TemplateResponse(request, f"_{name}" if fragment else name, context,
                                          status_code=status_code)
    response.headers.update(SECURITY_HEADERS)
    return response


@public.get("/login")
def login_form(request: Request):
    return page(request, "login.html", error=None)


@public.post("/login")
def login(request: Request, key: Annotated[str, Form()]):
    ring = key_ring_from_env()
    if ring.is_open or ring.caller(key) is None:
        response = page(request, "login.html", error="That key is not an API key of this fleet.")
        response.status_code = 401
        return response
    response = RedirectResponse("/ui", status_code=303)
    response.set_cookie(COOKIE, sessions(ring).dumps({"key": key_hash(key).hex()}), max_age=SESSION_SECONDS,
                        httponly=True, samesite="strict", path="/ui", secure=request.url.scheme == "https")
    return response


@public.post("/logout")
def logout():
    response = RedirectResponse("/ui/login", status_code=303)
    response.delete_cookie(COOKIE, path="/ui")
    return response


@public.get("/static/console.js")
def script():
    return FileResponse(HERE / "static" / "console.js", media_type="text/javascript")


@router.get("")
@router.get("/batches")
def batch_list(request: Request, r: RedisDep, services: ServicesDep, caller: ConsoleCaller,
               status: str | None = None, limit: int = 50):
    rows, view = [], outlook.FleetView(r, batches.load_many)  # the fleet's numbers, read once for the page
    batch_ids = batches.list_batch_ids(r, limit=200 if status else min(limit, 200),
                                       tenant=caller.listed_tenant)
    for fields in batches.load_many(r, batch_ids):
        if fields is None or (status and fields["status"] != status):  # None: listed while being created
            continue
        batch = batches.openai_object(r, fields, view)
        rate = services.batch_rates.rate(batch)
        eta = batch["eta_at"] - time.time() if batch["eta_at"] is not None else eta_seconds(batch, rate)
        rows.append({"batch": batch, "rate": rate, "eta": eta, "tenant": fields.get("tenant") or DEFAULT_TENANT})
        if len(rows) >= limit:
            break
    # The admin of a fleet with tenants sees each one's share, queue and deadlines first.
    shares = outlook.tenant_shares(r, batches.load_many) if caller.is_admin and key_ring_from_env().has_tenants \
        else None
    return page(request, "batches.html", rows=rows, status=status, statuses=STATUSES, shares=shares)


@router.get("/batches/{batch_id}")
def batch_page(request: Request, batch_id: str, r: RedisDep, services: ServicesDep, caller: ConsoleCaller,
               custom_id: str | None = None):
    try:
        fields = batches.owned_fields(r, batch_id, caller)
    except batches.BatchNotFound:  # absent, or another tenant's: 404 either way, as the API answers
        return page(request, "missing.html", status_code=404, what=f"batch {batch_id}")
    batch = batches.openai_object(r, fields)
    rate = services.batch_rates.rate(batch)
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


@router.post("/batches/{batch_id}/cancel")
def cancel(request: Request, batch_id: str, r: RedisDep, caller: ConsoleCaller):
    origin = request.headers.get("origin")
    if origin and origin.rstrip("/") != str(request.base_url).rstrip("/"):
        return Response("cross-origin request refused", status_code=403)
    with contextlib.suppress(batches.IllegalTransition, batches.BatchNotFound):
        batches.owned_fields(r, batch_id, caller)
        batches.transition(r, batch_id, "cancelling")  # if it cannot, the page shows why: its status
    return RedirectResponse(f"/ui/batches/{batch_id}", status_code=303)


@router.get("/files/{file_id}")
def download(file_id: str, r: RedisDep, caller: ConsoleCaller):
    try:
        info, chunks = owned_file(r, file_id, caller), read_file(r, file_id)
    except FileNotFound:
        return Response("no such file", status_code=404)
    return StreamingResponse(chunks, media_type="application/jsonl",
                             headers={"Content-Disposition": content_disposition(info["filename"])})


@router.get("/workers")
def workers(request: Request, r: RedisDep, services: ServicesDep, caller: ConsoleCaller):
    now = time.time()
    rows = []
    hidden = adapters.hidden_from(r, caller.tenant.name, caller.is_admin)  # other tenants' adapters
    for worker in heartbeats.live_workers(r):
        worker["models"] = [model for model in worker["models"] if model not in hidden]
        age = now - worker["heartbeat"]
        total = worker.get("total_blocks") or 0
        rows.append({"worker": worker, "age": age, "is_stale": age > 3 * worker.get("heartbeat_seconds", 1.0) + 2,
                     "kv_usage": 1 - worker.get("free_blocks", 0) / total if total else 0.0})
    return page(request, "workers.html", rows=rows, online=services.online_stats.summary(),
                models=sorted(set(heartbeats.served_models(r)) - hidden))


@router.get("/dead-letters")
def dead(request: Request, r: RedisDep, caller: ConsoleCaller):
    if not caller.is_admin:  # dead entries hold every tenant's request lines
        return page(request, "missing.html", status_code=404, what="dead letters (the admin key sees them)")
    return page(request, "dead_letters.html", entries=dead_letters.latest(r, 100))
