"""LoRA adapters that requests name by path or URI, and who may use them.

A worker started with `--lora-resolver PREFIX` loads on demand an adapter that a request names
by a folder or an s3:// URI under PREFIX (vLLM's resolver idea). The API registers such a name,
for the base model whose workers allow it, the first time a request names it; those workers
then serve it (workers/served_streams.py). The registry is one hash:

    kvfleet:lora-adapters   name -> {"base": model, "tenant": owner, "used_at": unix seconds}

Ownership. An adapter named by path belongs to the tenant whose request registered it: for
any other tenant it does not exist (404 model_not_found, as a model no worker serves), in
requests, in `GET /v1/models` and in the console. A PREFIX holding `{tenant}`
(`s3://models/adapters/{tenant}/`) gives each tenant a folder of its own, and a tenant may name
only adapters under its own: with it, no tenant can claim another's adapter first. Adapters
the operator names with `--lora-modules` are everyone's; the admin may use any.

Bounds. A name must lie strictly under a prefix, whole path segments matched (the prefix
itself, or `.../adapters-x/` for `.../adapters`, is refused); a tenant holds at most
KVFLEET_MAX_ADAPTERS_PER_TENANT names (64: a 429 names the quota); a name nobody used for
KVFLEET_ADAPTER_IDLE_SECONDS (7 days) is forgotten, and workers stop reading its queues.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

import redis

from jobs import heartbeats, keys

TENANT_PLACEHOLDER = "{tenant}"
DEFAULT_MAX_PER_TENANT = 64
DEFAULT_IDLE_SECONDS = 7 * 86400
TOUCH_SECONDS = 60.0  # a registration's used_at is written at most this often


class AdapterQuotaExceeded(Exception):
    """The tenant holds KVFLEET_MAX_ADAPTERS_PER_TENANT adapter names already."""


@dataclass(frozen=True)
class Registration:
    name: str
    base: str  # the base model whose workers load it
    tenant: str  # its owner
    used_at: float

    def may_use(self, tenant: str, is_admin: bool = False) -> bool:
        return is_admin or tenant == self.tenant


def max_per_tenant() -> int:
    return int(os.environ.get("KVFLEET_MAX_ADAPTERS_PER_TENANT") or DEFAULT_MAX_PER_TENANT)


def idle_seconds() -> float:
    return float(os.environ.get("KVFLEET_ADAPTER_IDLE_SECONDS") or DEFAULT_IDLE_SECONDS)


def under_prefix(model: str, prefixes: list[str], tenant: str | None) -> bool:
    """`model` lies strictly under one of the prefixes, whole segments matched, no '..' or empty
    segment in it; a prefix with {tenant} matches only under `tenant`'s own folder."""
    scheme, _, path = model.rpartition("://")
    segments = path.strip("/").split("/")
    if ".." in segments or "" in segments or "." in segments:
        return False
    for prefix in prefixes:
        if TENANT_PLACEHOLDER in prefix:
            if tenant is None:
                continue
            prefix = prefix.replace(TENANT_PLACEHOLDER, tenant)
        root = prefix.rstrip("/") + "/"
        if model.startswith(root) and model[len(root):].strip("/"):
            return True
    return False


def _decode(name: bytes | str, raw: bytes | str) -> Registration:
    text = raw.decode() if isinstance(raw, bytes) else raw
    name = name.decode() if isinstance(name, bytes) else name
    try:
        record = json.loads(text)
    except ValueError:
        record = {"base": text}  # a registration from before owners were kept: the default tenant's
    if not isinstance(record, dict):
        record = {"base": text}
    return Registration(name, str(record.get("base")), str(record.get("tenant") or "default"),
                        float(record.get("used_at") or 0))


def registrations(r: redis.Redis, now: float | None = None) -> dict[str, Registration]:
    """Every adapter name used within KVFLEET_ADAPTER_IDLE_SECONDS; older ones are forgotten."""
    now = time.time() if now is None else now
    found, idle = {}, []
    for name, raw in r.hgetall(keys.LORA_ADAPTERS).items():
        registration = _decode(name, raw)
        if now - registration.used_at > idle_seconds():
            idle.append(registration.name)
        else:
            found[registration.name] = registration
    if idle:
        r.hdel(keys.LORA_ADAPTERS, *idle)
    return found


def registration(r: redis.Redis, name: str) -> Registration | None:
    raw = r.hget(keys.LORA_ADAPTERS, name)
    if raw is None:
        return None
    found = _decode(name, raw)
    return found if time.time() - found.used_at <= idle_seconds() else None


def _write(r: redis.Redis, found: Registration, only_if_new: bool) -> bool:
    value = json.dumps({"base": found.base, "tenant": found.tenant, "used_at": int(found.used_at)})
    if only_if_new:
        return bool(r.hsetnx(keys.LORA_ADAPTERS, found.name, value))
    r.hset(keys.LORA_ADAPTERS, found.name, value)
    return True


def touch(r: redis.Redis, found: Registration) -> None:
    """The adapter was used now (written at most every TOUCH_SECONDS)."""
    if time.time() - found.used_at >= TOUCH_SECONDS:
        _write(r, Registration(found.name, found.base, found.tenant, time.time()), only_if_new=False)


def resolve(r: redis.Redis, model: str, tenant: str, is_admin: bool = False) -> str | None:
    """The base model whose live workers load adapter `model` for `tenant`, registering it on
    first use; None when no worker would, or it is another tenant's. Raises
    AdapterQuotaExceeded when registering it would pass the tenant's bound."""
    found = registration(r, model)
    if found is not None:
        if not found.may_use(tenant, is_admin):
            return None
        touch(r, found)
        return found.base
    base = next((worker["models"][0] for worker in heartbeats.live_workers(r)
                 if worker.get("task", "generate") == "generate"
                 and under_prefix(model, worker.get("lora_resolvers") or [], tenant)), None)
    if base is None:
        return None
    held = sum(1 for each in registrations(r).values() if each.tenant == tenant)
    if held >= max_per_tenant():
        raise AdapterQuotaExceeded(f"tenant {tenant!r} holds {held} adapter names "
                                   f"(KVFLEET_MAX_ADAPTERS_PER_TENANT {max_per_tenant()}); unused ones are "
                                   f"forgotten after KVFLEET_ADAPTER_IDLE_SECONDS")
    if not _write(r, Registration(model, base, tenant, time.time()), only_if_new=True):
        return resolve(r, model, tenant, is_admin)  # another request registered it first: whose is it?
    return base


def check_access(r: redis.Redis, model: str, tenant: str, is_admin: bool = False) -> bool:
    """Whether `tenant` may name `model`: anything but another tenant's registered adapter. A
    registered adapter of its own is marked used."""
    found = registration(r, model)
    if found is None:
        return True
    if not found.may_use(tenant, is_admin):
        return False
    touch(r, found)
    return True


def hidden_from(r: redis.Redis, tenant: str, is_admin: bool = False) -> set[str]:
    """The adapter names `tenant` must not see listed (other tenants' registrations)."""
    return set() if is_admin else {name for name, found in registrations(r).items() if found.tenant != tenant}
