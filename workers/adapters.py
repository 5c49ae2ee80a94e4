"""The LoRA adapters a worker serves, and which of their queues it reads now.

Names. `--lora-modules name=path` serves an adapter under its name: the name is a model of
its own in the fleet (its online stream and batch queues, `GET /v1/models` with the base as
`parent`). A request may also name an adapter by its folder or `s3://` URI (vLLM's resolver
idea) where `--lora-resolver` allows that prefix: the API registers the name for the base
whose workers allow it (jobs/heartbeats.py: `resolve_adapter`), and those workers add it to
what they serve. An s3:// adapter is downloaded once into `--lora-cache-dir`.

Pulling by adapter. Each worker advertises the adapters it holds (in a device slot, or with
requests queued in its engine). An adapter's queues are read by a worker that holds it; by
another only when it can load it without evicting an adapter with queued work and no live
worker holds it already; and by anyone once its queue has waited `--lora-wait-seconds`
(default 10) unread, so affinity never strands work. Loads per worker then stay near one
per adapter: the fleet splits the adapters instead of every worker loading all of them.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from engine import LoRARequest
from jobs import heartbeats, storage

S3_PREFIX = "s3://"


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


def download_s3_folder(uri: str, cache_dir: Path) -> Path:
    """Every object under the s3:// prefix, into a folder of `cache_dir` named by the URI's hash;
    a folder already complete is reused. ValueError when nothing is there."""
    bucket, _, prefix = uri.removeprefix(S3_PREFIX).partition("/")
    prefix = prefix.rstrip("/") + "/" if prefix else ""
    target = cache_dir / hashlib.sha256(uri.encode()).hexdigest()[:24]
    if (target / ".complete").exists():
        return target
    client = storage.s3_client()
    staging = Path(tempfile.mkdtemp(dir=cache_dir))
    found = 0
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for item in page.get("Contents", []):
            relative = item["Key"][len(prefix):]
            if not relative or relative.endswith("/") or ".." in Path(relative).parts:
                continue
            (staging / relative).parent.mkdir(parents=True, exist_ok=True)
            client.download_file(bucket, item["Key"], str(staging / relative))
            found += 1
    if not found:
        raise ValueError(f"model: no adapter files under {uri}")
    (staging / ".complete").touch()
    if target.exists():  # an earlier download that did not complete
        shutil.rmtree(target)
    os.replace(staging, target)
    return target


@dataclass
class Adapters:
    """The adapters this worker serves by name, and the prefixes it resolves on demand."""

    modules: dict[str, str]  # name -> folder or s3:// URI
    resolvers: list[str] = field(default_factory=list)  # prefixes a request's model may start with
    cache_dir: Path = field(default_factory=lambda: Path(tempfile.gettempdir()) / "kvfleet-lora-cache")
    ids: dict[str, int] = field(default_factory=dict)  # name -> vLLM's lora_int_id, in first-use order
    local: dict[str, str] = field(default_factory=dict)  # name -> its local folder, once resolved

    @property
    def enabled(self) -> bool:
        return bool(self.modules or self.resolvers)

    def allows(self, model: str) -> bool:
        """A request may name this model as an adapter loaded on demand."""
        return heartbeats.adapter_allowed(model, self.resolvers)

    def is_adapter(self, model: str) -> bool:
        return model in self.modules or self.allows(model)

    def request_for(self, model: str) -> LoRARequest | None:
        """The adapter a request for `model` runs with; None for a base model's name.
        ValueError (the request's error) when an s3:// adapter cannot be fetched."""
        if not self.is_adapter(model):
            return None
        if model not in self.local:
            source = self.modules.get(model, model)
            if source.startswith(S3_PREFIX):
                self.cache_dir.mkdir(parents=True, exist_ok=True)
                try:
                    source = str(download_s3_folder(source, self.cache_dir))
                except ValueError:
                    raise
                except Exception as error:  # botocore's errors: the request fails, not the worker
                    raise ValueError(f"model: adapter {model!r} could not be fetched: {error}") from None
            self.local[model] = source
        lora_id = self.ids.setdefault(model, len(self.ids) + 1)
        return LoRARequest(model, lora_id, self.local[model])


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
