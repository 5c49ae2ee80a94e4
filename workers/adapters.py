"""The LoRA adapters a worker serves, and which of their queues it reads now.

Names. `--lora-modules name=path` serves an adapter under its name: the name is a model of
its own in the fleet (its online stream and batch queues, `GET /v1/models` with the base as
`parent`), everyone's. A request may also name an adapter by its folder or `s3://` URI (vLLM's
resolver idea) where `--lora-resolver` allows that prefix: the API registers the name, for its
tenant, with the base whose workers allow it (jobs/adapters.py), and those workers add it to
what they serve; a request of another tenant for it is refused here too. An s3:// adapter is
downloaded once into `--lora-cache-dir`, in a thread (workers/adapter_downloads.py), while the
entries that name it wait parked (workers/lanes.py).

Pulling by adapter. Each worker advertises the adapters it holds (in a device slot, or with
requests queued in its engine). An adapter's queues are read by a worker that holds it; by
another only when it can load it without evicting an adapter with queued work and no live
worker holds it already; and by anyone once its queue has waited `--lora-wait-seconds`
(default 10) unread, so affinity never strands work. Loads per worker then stay near one
per adapter: the fleet splits the adapters instead of every worker loading all of them.
"""

from __future__ import annotations

import hashlib
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from engine import LoRARequest
from jobs import adapters as jobs_adapters
from jobs.tenants import ADMIN_TENANT
from workers.adapter_downloads import (
    DEFAULT_CACHE_BYTES,
    DEFAULT_MAX_ADAPTER_BYTES,
    S3_PREFIX,
    AdapterDownloads,
)
from workers.translate import RequestRejected


def parse_lora_modules(values: list[str] | None, base_names: list[str]) -> dict[str, str]:
    """`name=path` pairs (vLLM's --lora-modules form) -> {name: path}; ValueError naming the bad one."""
    modules: dict[str, str] = {}
    for value in values or []:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules: {value!r} is not name=path")
        if name in modules or name in base_names:
            raise ValueError(f"--lora-modules: the name {name!r} is used twice")
        modules[name] = path
    return modules


@dataclass
class Adapters:
    """The adapters this worker serves by name, and the prefixes it resolves on demand."""

    modules: dict[str, str]  # name -> folder or s3:// URI: the operator's, everyone's
    resolvers: list[str] = field(default_factory=list)  # prefixes a request's model may lie under ({tenant})
    cache_dir: Path = field(default_factory=lambda: Path(tempfile.gettempdir()) / "kvfleet-lora-cache")
    max_bytes: int = DEFAULT_MAX_ADAPTER_BYTES  # of one adapter's weights file (--max-lora-bytes)
    cache_bytes: int = DEFAULT_CACHE_BYTES  # of the download cache (--lora-cache-bytes)
    ids: dict[str, int] = field(default_factory=dict)  # name -> vLLM's lora_int_id, in first-use order
    local: dict[str, str] = field(default_factory=dict)  # name -> its local folder, once resolved
    owners: dict[str, str] = field(default_factory=dict)  # resolved name -> its tenant (jobs/adapters.py)
    downloads: AdapterDownloads | None = field(default=None, repr=False)

    @property
    def enabled(self) -> bool:
        return bool(self.modules or self.resolvers)

    def allows(self, model: str, tenant: str | None) -> bool:
        """A request of `tenant` may name this model as an adapter loaded on demand."""
        return jobs_adapters.under_prefix(model, self.resolvers, tenant)

    def is_adapter(self, model: str) -> bool:
        return model in self.modules or model in self.owners

    def source(self, model: str) -> str:
        return self.modules.get(model, model)

    def is_ready(self, model: str) -> bool:
        """Whether a request for `model` can be prepared now: not an adapter, local, or its
        download has ended (fetched or failed); else its download is started or under way."""
        if not self.is_adapter(model) or model in self.local or not self.source(model).startswith(S3_PREFIX):
            return True
        if self.downloads is None:
            self.downloads = AdapterDownloads(self.cache_dir, self.max_bytes, self.cache_bytes)
        return self.downloads.poll(self.source(model))

    def request_for(self, model: str, tenant: str) -> LoRARequest | None:
        """The adapter a request of `tenant` for `model` runs with; None for a base model's name.
        RequestRejected when it is another tenant's (or forgotten), or cannot be fetched."""
        if not self.is_adapter(model):
            return None
        owner = self.owners.get(model)
        if model not in self.modules and (owner is None or not self.allows(model, owner)
                                          or tenant not in (owner, ADMIN_TENANT)):
            raise RequestRejected("model_not_found", f"model: the model {model!r} does not exist")
        if model not in self.local:
            source = self.source(model)
            if source.startswith(S3_PREFIX):
                self.is_ready(model)  # a caller that did not wait: starts it
                source = str(self.downloads.folder(source))
            self.local[model] = source
        lora_id = self.ids.setdefault(model, len(self.ids) + 1)
        return LoRARequest(model, lora_id, self.local[model])

    def forget(self, model: str) -> None:
        """A resolved adapter left the registry (unused too long): it is no longer served here."""
        self.owners.pop(model, None)
        self.local.pop(model, None)


@dataclass
class AdapterPreference:
    """Whether this worker reads an adapter's queues now (pulling by adapter, above)."""

    name: str  # this worker
    max_loras: int
    wait_seconds: float = 10.0
    clock: object = time.monotonic
    held_elsewhere: dict[str, set[str]] = field(default_factory=dict)  # adapter -> other live workers holding it
    skipped_since: dict[str, float] = field(default_factory=dict)  # adapter -> first unread moment with work

    def refresh(self, records: list[dict]) -> None:
        """`records`: jobs.heartbeats.live_workers()."""
        held: dict[str, set[str]] = {}
        for record in records:
            if record["name"] != self.name and not record.get("draining"):
                for adapter in record.get("lora_held") or []:
                    held.setdefault(adapter, set()).add(record["name"])
        self.held_elsewhere = held

    def choose(self, adapters: list[str], held: set[str], busy: set[str]) -> set[str]:
        """Of the adapters whose queues have new entries, those to read now. `held`: in a slot
        or queued here; `busy`: with requests queued or running here (never evicted)."""
        now = self.clock()
        loadable = self.max_loras - len(busy)  # slots free of work: each may take a new adapter
        chosen = set()
        # Unheld adapters first, the longest skipped first, then in an order of this worker's own
        # (rendezvous hashing): workers that start together reach for different adapters.
        order = lambda a: (a in self.held_elsewhere, self.skipped_since.get(a, now),  # noqa: E731
                           hashlib.blake2b(f"{self.name}\n{a}".encode(), digest_size=8).digest())
        for adapter in sorted(adapters, key=order):
            if adapter in held:
                chosen.add(adapter)
            elif loadable > 0 and adapter not in self.held_elsewhere:
                chosen.add(adapter)
                loadable -= 1
            elif now - self.skipped_since.setdefault(adapter, now) >= self.wait_seconds:
                chosen.add(adapter)  # waited long enough for a holder: any worker takes it
        for adapter in chosen:
            self.skipped_since.pop(adapter, None)
        for adapter in set(self.skipped_since) - set(adapters):
            del self.skipped_since[adapter]  # no longer waiting
        return chosen
