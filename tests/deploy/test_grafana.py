"""The Grafana dashboard asks only for metrics kvfleet exports: every metric name in
every panel's PromQL is a sample name of the worker's or the API's registry."""

from __future__ import annotations

import json
import re
from pathlib import Path

from producers.api import create_app
from workers.metrics import WorkerMetrics

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = json.loads((ROOT / "deploy" / "grafana" / "dashboards" / "kvfleet.json").read_text())
METRIC = re.compile(r"\bkvfleet:[a-zA-Z_:][a-zA-Z0-9_:]*")


SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}


def exported_sample_names() -> set[str]:
    """What Prometheus stores for each metric family (a labelled family has no samples until
    its first child, so the names come from the family's type)."""
    registries = [WorkerMetrics("w", "m").registry, create_app("redis://127.0.0.1:1/0").state.metrics_registry]
    return {family.name + suffix for registry in registries for family in registry.collect()
            for suffix in SUFFIXES[family.type]}


def test_every_metric_in_the_dashboard_is_exported():
    exported = exported_sample_names()
    queried = {name for panel in DASHBOARD["panels"] for target in panel["targets"]
               for name in METRIC.findall(target["expr"])}
    assert queried - exported == set(), f"not exported: {sorted(queried - exported)}"
    assert len(queried) >= 12


def test_the_dashboard_has_the_panels_an_operator_asks_for():
    titles = " | ".join(panel["title"] for panel in DASHBOARD["panels"]).lower()
    for words in ("tokens/s", "running, waiting, unstarted", "kv-cache", "preemptions", "lag and pending",
                  "time to first token", "inter-token", "finished by reason", "dead letters"):
        assert words in titles, words
    exprs = [target["expr"] for panel in DASHBOARD["panels"] for target in panel["targets"]]
    assert any("by (worker)" in e and "generation_tokens_total" in e for e in exprs)  # per worker ...
    assert any(e.startswith("sum(rate(kvfleet:generation_tokens_total") for e in exprs)  # ... and in total
    assert sum("by (le, lane)" in e for e in exprs) == 4  # TTFT and ITL p50/p99 per lane
    assert {panel["datasource"]["uid"] for panel in DASHBOARD["panels"]} == {"kvfleet-prometheus"}
    ids = [panel["id"] for panel in DASHBOARD["panels"]]
    assert len(ids) == len(set(ids))
