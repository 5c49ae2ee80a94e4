"""Tenants: which team a caller is, from its API key, and which team owns a file or a batch.

The operator maps keys to tenants in the API's environment:

    KVFLEET_API_KEYS  = KEY=TENANT[:WEIGHT],KEY=TENANT[:WEIGHT],...
                      or @/path/keys.json: {"KEY": {"tenant": "...", "weight": 1,
                                                    "max_queued_lines": N, "max_inflight_tokens": N,
                                                    "max_open_batches": N}}
    KVFLEET_API_KEY   = one key, of tenant `default` (the single-team setup; both may be set;
                        alone, with neither of the others, it is also the admin)
    KVFLEET_ADMIN_KEY = the operator's key: it sees and may act on every tenant's work; it is
                        tenant `admin` (a reserved name), so what it creates belongs to no team

With no key set at all the API is open and every caller is the admin: one team, as before
tenants existed. Every file and batch records its creator's tenant; an object made before
tenants existed belongs to `default`. Another tenant's object does not exist for a caller:
404 on every route, never 403, so ids cannot be probed.

Keys are looked up by their SHA-256 (the same time for every key; the key ring keeps no key
in memory). No torch here: the API and the workers (fair share, by weight) both read it.

Quotas: `max_open_batches` (10,000 unless set) and `max_queued_lines` are checked when a batch is
created (producers/routes/batches.py);
`max_inflight_tokens` bounds a tenant's online requests not yet answered, each counted at
`estimated_tokens` in a sorted set by deadline (`reserve_tokens`, one script).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import redis

from jobs import keys

DEFAULT_TENANT = "default"
DEFAULT_MAX_OPEN_BATCHES = 10_000  # per tenant: each open batch is a queue of its own
ADMIN_TENANT = "admin"  # KVFLEET_ADMIN_KEY's own identity: what it creates is no team's, its Idempotency-Keys its own
TENANT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")  # a Redis key part and a metric label


class KeyConfigError(ValueError):
    """KVFLEET_API_KEYS or its file is malformed: the message names the entry and the field."""


@dataclass(frozen=True)
class Tenant:
    name: str
    weight: float = 1.0  # its share of the fleet against the others'
    max_queued_lines: int | None = None  # batch lines submitted and not yet finished; None: no limit
    max_open_batches: int | None = DEFAULT_MAX_OPEN_BATCHES  # batches not yet ended; None: no limit
    max_inflight_tokens: int | None = None  # online prompt + max_tokens not yet answered; None: no limit


@dataclass(frozen=True)
class Caller:
    tenant: Tenant
    is_admin: bool = False

    def owns(self, owner: str | None) -> bool:
        """Whether this caller may see an object its `owner` tenant made."""
        return self.is_admin or (owner or DEFAULT_TENANT) == self.tenant.name

    @property
    def listed_tenant(self) -> str | None:
        """Whose objects this caller's lists show: its tenant's, or every one's (None) for the admin."""
        return None if self.is_admin else self.tenant.name


OPEN = Caller(Tenant(DEFAULT_TENANT), is_admin=True)  # no key configured


@dataclass(frozen=True)
class KeyRing:
    by_hash: dict[bytes, Caller] = field(default_factory=dict)  # sha256(key) -> caller

    @property
    def is_open(self) -> bool:
        return not self.by_hash

    @property
    def has_tenants(self) -> bool:
        """More than one team holds keys (KVFLEET_API_KEYS is set), not one team's single key."""
        return len({caller.tenant.name for caller in self.by_hash.values()}) > 1

    def caller(self, token: str) -> Caller | None:
        """The caller a bearer token stands for; None: no such key."""
        if self.is_open:
            return OPEN
        return self.by_hash.get(key_hash(token))


def key_hash(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def key_ring_from_env(env: dict[str, str] | None = None) -> KeyRing:
    """The key ring the environment describes (cached on the variables and the file's mtime)."""
    env = dict(os.environ) if env is None else env
    spec = env.get("KVFLEET_API_KEYS", "").strip()
    mtime = Path(spec[1:]).stat().st_mtime if spec.startswith("@") and Path(spec[1:]).exists() else None
    return _key_ring(spec, env.get("KVFLEET_API_KEY") or "", env.get("KVFLEET_ADMIN_KEY") or "", mtime)


@lru_cache(maxsize=8)
def _key_ring(spec: str, single_key: str, admin_key: str, mtime: float | None) -> KeyRing:
    by_hash: dict[bytes, Caller] = {}
    tenants = parse_keys(spec)
    if single_key:
        tenants.setdefault(single_key, Tenant(DEFAULT_TENANT))
    for key, tenant in tenants.items():
        # The single key alone is one team's, as before tenants: it sees everything there is.
        by_hash[key_hash(key)] = Caller(tenant, is_admin=not spec and not admin_key)
    if admin_key:
        by_hash[key_hash(admin_key)] = Caller(Tenant(ADMIN_TENANT), is_admin=True)
    return KeyRing(by_hash)


def parse_keys(spec: str) -> dict[str, Tenant]:
    """KVFLEET_API_KEYS, inline or `@file`: key -> tenant."""
    if not spec:
        return {}
    if spec.startswith("@"):
        path = Path(spec[1:])
        try:
            entries = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise KeyConfigError(f"KVFLEET_API_KEYS file {path}: {error}") from None
        if not isinstance(entries, dict):
            raise KeyConfigError(f"KVFLEET_API_KEYS file {path}: must be an object of key -> tenant")
        return {key: tenant_from_json(key, value, f"{path}: key #{i + 1}") for i, (key, value) in
                enumerate(entries.items())}
    tenants = {}
    for i, entry in enumerate(spec.split(",")):
        key, sep, rest = entry.strip().partition("=")
        name, _, weight = rest.partition(":")
        where = f"KVFLEET_API_KEYS entry #{i + 1}"
        if not key or not sep:
            raise KeyConfigError(f"{where}: expected KEY=TENANT[:WEIGHT]")
        tenants[key] = tenant_from_json(key, {"tenant": name, **({"weight": weight} if weight else {})}, where)
    return tenants


def tenant_from_json(key: str, value: Any, where: str) -> Tenant:
    if not isinstance(value, dict):
        raise KeyConfigError(f"{where}: must be an object with a 'tenant'")
    unknown = set(value) - {"tenant", "weight", "max_queued_lines", "max_inflight_tokens", "max_open_batches"}
    if unknown:
        raise KeyConfigError(f"{where}: unknown field {sorted(unknown)[0]!r}")
    name = value.get("tenant")
    if not isinstance(name, str) or not TENANT_NAME.match(name):
        raise KeyConfigError(f"{where}: tenant must be 1-64 letters, digits, '_', '.' or '-'")
    if name == ADMIN_TENANT:
        raise KeyConfigError(f"{where}: tenant {ADMIN_TENANT!r} is reserved for KVFLEET_ADMIN_KEY")
    if len(key) < 8:
        raise KeyConfigError(f"{where}: the key must be at least 8 characters")
    return Tenant(name, weight=_number(value, "weight", where, float, 1.0),
                  max_queued_lines=_number(value, "max_queued_lines", where, int, None),
                  max_open_batches=_number(value, "max_open_batches", where, int, DEFAULT_MAX_OPEN_BATCHES),
                  max_inflight_tokens=_number(value, "max_inflight_tokens", where, int, None))


def _number(value: dict, name: str, where: str, kind: type, default: Any) -> Any:
    raw = value.get(name, default)
    if raw is None:
        return None
    try:
        number = kind(raw)
    except (TypeError, ValueError):
        raise KeyConfigError(f"{where}: {name} must be a positive number") from None
    if number <= 0 or isinstance(raw, bool):
        raise KeyConfigError(f"{where}: {name} must be a positive number")
    return number


# In-flight online tokens. KEYS: the tenant's in-flight set (member "request_id tokens", score
# its deadline). ARGV: now, the limit, the member, its tokens, its deadline. Drops the members
# past their deadline (an API process that died never released them), then adds the new one
# if the sum stays within the limit; returns the sum before it, negated when refused.
_RESERVE_LUA = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
local total = 0
for _, member in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  total = total + tonumber(string.match(member, ' (%d+)$'))
end
if total + tonumber(ARGV[4]) > tonumber(ARGV[2]) then return -total - 1 end
redis.call('ZADD', KEYS[1], ARGV[5], ARGV[3])
redis.call('EXPIREAT', KEYS[1], math.ceil(tonumber(ARGV[5])) + 60)
return total
"""


def estimated_tokens(prompt_text: str, body: dict[str, Any], default_max_tokens: int = 1024) -> int:
    """What an online request may hold, without a tokenizer (the API loads none): its prompt
    at 4 characters a token, plus max_tokens (DEFAULT when unset) for each of its n choices."""
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or body.get("max_output_tokens") \
        or default_max_tokens
    return -(-len(prompt_text) // 4) + int(max_tokens) * int(body.get("n") or 1)


def reserve_tokens(r: redis.Redis, tenant: Tenant, request_id: str, tokens: int, deadline: float) -> int | None:
    """Count an online request's tokens as in flight for its tenant until `release_tokens` or
    its deadline; None if that passes max_inflight_tokens, else the tokens in flight before."""
    if tenant.max_inflight_tokens is None:
        return 0
    held = r.eval(_RESERVE_LUA, 1, keys.tenant_inflight(tenant.name), repr(time.time()), tenant.max_inflight_tokens,
                  f"{request_id} {tokens}", tokens, repr(deadline))
    return None if held < 0 else held


def inflight_tokens(r: redis.Redis, tenant: str) -> int:
    return sum(int(member.rsplit(b" ", 1)[1]) for member in
               r.zrangebyscore(keys.tenant_inflight(tenant), time.time(), "+inf"))


def release_tokens(r: redis.Redis, tenant: str, request_id: str, tokens: int) -> None:
    """Free an online request's tokens, and wake the tenant's requests waiting for them
    (producers/token_waits.py)."""
    if r.zrem(keys.tenant_inflight(tenant), f"{request_id} {tokens}"):
        r.publish(keys.tokens_freed(tenant), tokens)


def publish_weights(r: redis.Redis, ring: KeyRing) -> dict[str, float]:
    """Put the ring's tenant weights where the workers' fair share reads them (the API does
    this at start-up: the workers never see the keys). A tenant not listed weighs 1."""
    found: dict[str, float] = {}
    for caller in sorted(ring.by_hash.values(), key=lambda c: c.is_admin):  # a tenant's own key first
        found.setdefault(caller.tenant.name, caller.tenant.weight)
    if found:
        r.hset(keys.TENANT_WEIGHTS, mapping={name: repr(weight) for name, weight in found.items()})
    return found


def weights(r: redis.Redis) -> dict[str, float]:
    """Tenant -> fair-share weight, as the API published them."""
    return {name.decode(): float(weight) for name, weight in r.hgetall(keys.TENANT_WEIGHTS).items()}
