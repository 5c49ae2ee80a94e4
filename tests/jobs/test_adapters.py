"""Adapters named by path (jobs/adapters.py): whole-segment prefixes, {tenant} folders, the
owner's alone, a bounded registry per tenant that forgets idle names; and the worker's side
(workers/served_streams.py, workers/adapters.py) serving and refusing by the same rules."""

from __future__ import annotations

import json
import time

import pytest

from jobs import adapters, heartbeats, keys
from workers import served_streams
from workers.adapters import Adapters
from workers.served_streams import ServedStreams
from workers.translate import RequestRejected

PREFIXES = ["s3://models/adapters", "s3://models/tenants/{tenant}/"]


@pytest.mark.parametrize("model, tenant, allowed", [
    ("s3://models/adapters/sql-v2", "acme", True),
    ("s3://models/adapters/team/sql-v2/", "acme", True),
    ("s3://models/adapters", "acme", False),  # the prefix itself: every adapter under it
    ("s3://models/adapters/", "acme", False),
    ("s3://models/adapters-x/sql", "acme", False),  # another folder that starts with the same text
    ("s3://models/adapters/../secrets/x", "acme", False),
    ("s3://models/adapters//tmp/x", "acme", False),
    ("s3://models/tenants/acme/sql", "acme", True),
    ("s3://models/tenants/acme/sql", "globex", False),  # another tenant's folder
    ("s3://models/tenants/acme/sql", None, False),
    ("s3://models/tenants/acme", "acme", False),
])
def test_names_lie_strictly_under_a_prefix_by_whole_segments(model, tenant, allowed):
    assert adapters.under_prefix(model, PREFIXES, tenant) is allowed


@pytest.fixture
def resolver_worker(r):
    heartbeats.record_heartbeat(r, "w1", {"models": ["base"], "root": "base", "lora_resolvers": PREFIXES}, 60)


def test_an_adapter_is_its_registering_tenants_own(r, resolver_worker):
    name = "s3://models/adapters/sql-v2"
    assert adapters.resolve(r, name, "acme") == "base"
    assert adapters.resolve(r, name, "globex") is None  # as if no worker served it
    assert not adapters.check_access(r, name, "globex") and adapters.check_access(r, name, "acme")
    assert adapters.resolve(r, name, "admin", is_admin=True) == "base"
    assert adapters.check_access(r, "base", "globex")  # a base model is everyone's
    assert adapters.hidden_from(r, "globex") == {name} and adapters.hidden_from(r, "acme") == set()
    assert adapters.resolve(r, "s3://models/tenants/acme/x", "globex") is None  # never registered for globex
    assert adapters.registration(r, "s3://models/tenants/acme/x") is None


def test_a_tenant_holds_a_bounded_number_of_names_and_idle_ones_are_forgotten(r, resolver_worker, monkeypatch):
    monkeypatch.setenv("KVFLEET_MAX_ADAPTERS_PER_TENANT", "3")
    for index in range(3):
        assert adapters.resolve(r, f"s3://models/adapters/junk-{index}", "spammer") == "base"
    with pytest.raises(adapters.AdapterQuotaExceeded, match="holds 3 adapter names"):
        adapters.resolve(r, "s3://models/adapters/junk-3", "spammer")
    assert adapters.resolve(r, "s3://models/adapters/real", "acme") == "base"  # another tenant's bound is its own
    old = json.dumps({"base": "base", "tenant": "spammer", "used_at": int(time.time()) - 8 * 86400})
    r.hset(keys.LORA_ADAPTERS, "s3://models/adapters/junk-0", old)  # unused for 8 days
    assert adapters.resolve(r, "s3://models/adapters/junk-3", "spammer") == "base"  # junk-0 was forgotten
    assert "s3://models/adapters/junk-0" not in adapters.registrations(r)
    assert not r.hexists(keys.LORA_ADAPTERS, "s3://models/adapters/junk-0")


def test_a_worker_serves_the_most_recently_used_and_drops_forgotten_names(r, resolver_worker, monkeypatch):
    monkeypatch.setattr(served_streams, "MAX_SERVED_MODELS", 3)
    now = time.time()
    for index, tenant in enumerate(["acme", "globex", "acme"]):
        r.hset(keys.LORA_ADAPTERS, f"s3://models/adapters/a{index}",
               json.dumps({"base": "base", "tenant": tenant, "used_at": now - 100 * (3 - index)}))
    r.hset(keys.LORA_ADAPTERS, "s3://elsewhere/a9", json.dumps({"base": "base", "tenant": "acme", "used_at": now}))
    served = Adapters({}, PREFIXES)
    streams = ServedStreams(r, ["base"], adapters=served, bases=["base"])
    streams.add_requested_adapters()
    assert streams.models == ["base", "s3://models/adapters/a2", "s3://models/adapters/a1"]  # newest first, bounded
    assert keys.online_stream("s3://models/adapters/a2") in streams.online
    assert served.owners == {"s3://models/adapters/a2": "acme", "s3://models/adapters/a1": "globex"}
    r.hdel(keys.LORA_ADAPTERS, "s3://models/adapters/a2")  # forgotten
    streams.add_requested_adapters()
    assert streams.models == ["base", "s3://models/adapters/a1", "s3://models/adapters/a0"]
    assert keys.online_stream("s3://models/adapters/a2") not in streams.online


def test_a_worker_refuses_another_tenants_adapter(tmp_path):
    folder = tmp_path / "adapters" / "sql"
    served = Adapters({"shared": str(folder)}, [str(tmp_path / "adapters")])
    served.owners[str(folder)] = "acme"
    assert served.request_for(str(folder), "acme").lora_path == str(folder)
    assert served.request_for(str(folder), "admin").lora_path == str(folder)
    with pytest.raises(RequestRejected) as refused:
        served.request_for(str(folder), "globex")
    assert refused.value.code == "model_not_found"
    assert served.request_for("shared", "globex").lora_path == str(folder)  # the operator's: everyone's
    assert served.request_for("base", "globex") is None
