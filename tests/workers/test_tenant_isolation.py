"""Tenants share no cached prompt blocks unless the operator says so: `cached_tokens` never
tells one tenant what another sent. Within a tenant, a request's `cache_salt` (vLLM's)
keeps its own namespace too."""

from __future__ import annotations

import pytest

from engine import EngineConfig, LLMEngine
from tests.workers.helpers import completion, make_worker, read_lines, run_until, submit_lines

SECRET = "Quarterly revenue of the merger target, strictly confidential: " * 6  # ~380 tokens of the tiny vocabulary


@pytest.fixture
def engine(tiny_llama):
    return LLMEngine(EngineConfig(model=tiny_llama, num_kv_blocks=256, max_num_seqs=4))


def cached_tokens(worker, r, tenant: str, **fields) -> int:
    """Run one request of `tenant` through the worker; its result's cached_tokens."""
    batch_id = submit_lines(r, [completion("probe", SECRET, max_tokens=2, **fields)], tenant=tenant)
    done = run_until(worker, r, [batch_id], timeout=60)[batch_id]
    [line] = read_lines(r, done["output_file_id"])
    return line["response"]["body"]["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_another_tenant_never_learns_what_was_cached_for_one(engine, r):
    worker = make_worker(engine, r)
    assert cached_tokens(worker, r, "acme") == 0
    assert cached_tokens(worker, r, "acme") > 0  # its own prompt, cached for it
    assert cached_tokens(worker, r, "globex") == 0  # the same prompt, another tenant: nothing to learn
    assert cached_tokens(worker, r, "acme", cache_salt="run-2") == 0  # a salt of its own: its own namespace
    assert cached_tokens(worker, r, "acme", cache_salt="run-2") > 0


def test_the_operator_may_share_the_cache_across_tenants(engine, r):
    worker = make_worker(engine, r, shared_prefix_cache=True)
    assert cached_tokens(worker, r, "acme") == 0
    assert cached_tokens(worker, r, "globex") > 0
