"""When an open batch will finish at the fleet's current rate: the kvfleet extension fields
`eta_at` (unix seconds, or null when nothing tells) and `at_risk` of the batch object.

Two estimates, the first that has something to go on:

  * the batch's own pace, once it has results: its remaining requests at the rate it has
    counted them since it was created (queue time included, so early on it errs late);
  * before that, the fleet's: the tokens left in its tenant's batches for the model due no
    later than it (itself included; fair share runs them first), over the rate the live
    workers of the model finish batch work (their heartbeats' batch_tokens_per_s) times the
    tenant's share (its weight over those of the tenants with work queued for the model).
    Tokens are counted as fair share counts them: prompt + max output (jobs/tenants.py).

`at_risk` is eta_at past the deadline (expires_at): flagged as soon as the pace says so, not
at the deadline. A batch no worker serves has no ETA and is not flagged: autoscaling may start
one.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import redis

from jobs import heartbeats, keys, queues, tenants
from jobs.tenants import DEFAULT_TENANT

LoadMany = Callable[[redis.Redis, list[str]], list[dict[str, Any] | None]]


def remaining(fields: dict[str, Any]) -> int:
    return max(0, fields["total"] - fields["completed"] - fields["failed"])


def remaining_tokens(fields: dict[str, Any]) -> float:
    total = fields["total"]
    return int(fields.get("estimated_tokens") or 0) * remaining(fields) / total if total else 0.0


def tenant_of(fields: dict[str, Any]) -> str:
    return fields.get("tenant") or DEFAULT_TENANT


class FleetView:
    """What the fleet estimate reads from Redis, read once for every batch of one call (a
    page of a list): the model's worker rate, its queued batches, the tenants' weights."""

    def __init__(self, r: redis.Redis, load_many: LoadMany) -> None:
        self.r, self.load_many = r, load_many
        self._rates: dict[str, float] | None = None
        self._queued: dict[str, list[dict[str, Any]]] = {}
        self._weights: dict[str, float] | None = None

    def rate(self, model: str) -> float:
        """Batch tokens per second the model's live workers finish (their heartbeats)."""
        if self._rates is None:
            self._rates = {}
            for worker in heartbeats.live_workers(self.r):
                for name in worker["models"]:
                    self._rates[name] = self._rates.get(name, 0.0) + worker.get("batch_tokens_per_s", 0.0)
        return self._rates.get(model, 0.0)

    def queued(self, model: str) -> list[dict[str, Any]]:
        """The fields of the model's batches with requests left."""
        if model not in self._queued:
            batch_ids = sorted({queue.batch_id for queue in queues.registered(self.r, [model])})
            self._queued[model] = [f for f in self.load_many(self.r, batch_ids) if f and remaining(f)]
        return self._queued[model]

    def weight(self, tenant: str) -> float:
        if self._weights is None:
            self._weights = tenants.weights(self.r)
        return self._weights.get(tenant, 1.0)


def eta(fields: dict[str, Any], view: FleetView, now: float | None = None) -> float | None:
    """Unix seconds when the open batch should be done; None when nothing tells."""
    now = time.time() if now is None else now
    left = remaining(fields)
    if not left:
        return now
    counted = fields["total"] - left
    if counted and now > fields["created_at"]:
        return now + left * (now - fields["created_at"]) / counted
    return fleet_eta(fields, view, now)


def fleet_eta(fields: dict[str, Any], view: FleetView, now: float) -> float | None:
    rate = view.rate(fields["model"])
    if rate <= 0:
        return None
    queued = [f for f in view.queued(fields["model"]) if f["id"] != fields["id"]] + [fields]
    tenant = tenant_of(fields)
    share = view.weight(tenant) / sum(view.weight(t) for t in {tenant_of(f) for f in queued})
    ahead = sum(remaining_tokens(f) for f in queued
                if tenant_of(f) == tenant and f["expires_at"] <= fields["expires_at"])
    return now + ahead / (rate * share)


def annotate(fields: dict[str, Any], view: FleetView) -> dict[str, Any]:
    """`fields` with eta_at and at_risk set (an ended batch has neither)."""
    if fields["status"] not in ("validating", "in_progress"):
        return {**fields, "eta_at": None, "at_risk": False}
    eta_at = eta(fields, view)
    return {**fields, "eta_at": None if eta_at is None else int(eta_at),
            "at_risk": eta_at is not None and eta_at > fields["expires_at"]}


def tenant_shares(r: redis.Redis, load_many: LoadMany) -> list[dict[str, Any]]:
    """Per tenant with open batches, for the admin's console: its weight, its share of the
    batch work now (its weight over those of the tenants with requests queued; 0 with none),
    its requests left, open batches, next deadline and batches at risk."""
    batch_ids = sorted(batch_id.decode() for batch_id in r.smembers(keys.OPEN_BATCHES))
    open_batches = [f for f in load_many(r, batch_ids) if f and f["status"] in ("validating", "in_progress")]
    view = FleetView(r, load_many)
    rows: dict[str, dict[str, Any]] = {}
    for fields in open_batches:
        row = rows.setdefault(tenant_of(fields), {"tenant": tenant_of(fields), "weight": 0.0, "share": 0.0,
                                                  "remaining": 0, "batches": 0, "next_deadline": None,
                                                  "at_risk": 0})
        row["remaining"] += remaining(fields)
        row["batches"] += 1
        row["next_deadline"] = min(fields["expires_at"], row["next_deadline"] or fields["expires_at"])
        row["at_risk"] += annotate(fields, view)["at_risk"]
    for row in rows.values():
        row["weight"] = view.weight(row["tenant"])
    total = sum(row["weight"] for row in rows.values() if row["remaining"])
    for row in rows.values():
        row["share"] = row["weight"] / total if row["remaining"] else 0.0
    return sorted(rows.values(), key=lambda row: row["tenant"])
