"""Prefix hashes computed by producers (jobs/prefixes.py), and submit keeping the lines that
share a prefix together in the stream."""

from __future__ import annotations

import json
import random

from jobs import keys, prefixes
from jobs.entries import BatchEntry
from jobs.prefixes import CHUNK_CHARS, MAX_CHUNKS, group_order, prefix_hashes, prompt_text
from tests.workers.helpers import MODEL, submit_lines


def text(seed: int, n: int) -> str:
    rng = random.Random(seed)
    return "".join(rng.choice("abcdefgh ") for _ in range(n))


def test_two_prompts_share_k_hashes_exactly_when_they_share_k_full_chunks():
    shared = text(1, 3 * CHUNK_CHARS + 100)
    a, b = prefix_hashes(shared + text(2, 600)), prefix_hashes(shared + text(3, 600))
    assert a[:3] == b[:3] and a[3] != b[3]  # the fourth chunk holds 100 shared characters, then differs
    assert len(a) == (len(shared) + 600) // CHUNK_CHARS
    assert prefix_hashes(text(1, CHUNK_CHARS - 1)) == []  # only full chunks
    assert len(prefix_hashes(text(4, CHUNK_CHARS * (MAX_CHUNKS + 5)))) == MAX_CHUNKS
    chunk = text(5, CHUNK_CHARS)
    assert len(set(prefix_hashes(chunk * 3))) == 3  # chained: the same chunk elsewhere hashes otherwise
    tenants = [prefix_hashes(shared, prefixes.salt_of(tenant, {})) for tenant in ("acme", "globex")]
    assert len(tenants[0]) == 3 and not set(tenants[0]) & set(tenants[1])  # each tenant's groups are its own
    assert prefix_hashes(shared, prefixes.salt_of("acme", {"cache_salt": "s"})) != tenants[0]


def test_prompt_text_is_what_the_worker_will_tokenize():
    assert prompt_text({"prompt": "Once upon"}) == "Once upon"
    assert prompt_text({"prompt": [5, 6, 7]}) == "5,6,7"
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    # Canonical JSON in the messages' order: requests that share their leading turns share text.
    assert prompt_text({"messages": messages}) == '[{"content":"Be brief.","role":"system"},' \
                                                  '{"content":"Hi","role":"user"}]'
    assert prompt_text({"input": "embed me"}) == ""


def test_group_order_is_a_trie_in_order_of_first_appearance():
    chains = [["a", "x"], [], ["b"], ["a", "y"], ["a", "x", "z"], ["c"], ["b"]]
    assert group_order(chains) == [0, 4, 3, 1, 2, 6, 5]
    assert group_order([["a"], ["b"], [], ["c"]]) == [0, 1, 2, 3]  # nothing shared: the file's order


def test_submit_keeps_interleaved_groups_together_in_the_stream(r):
    groups = [text(10 + g, 2 * CHUNK_CHARS) for g in range(4)]
    records = []
    for i in range(24):  # group g's lines at g, g + 4, g + 8, ...: interleaved in the file
        prompt = groups[i % 4] + f" question {i}" if i < 20 else f"lone prompt {i}"
        records.append({"custom_id": f"c{i}", "prompt": prompt, "max_tokens": 4})
    batch_id = submit_lines(r, records)
    entries = [BatchEntry.from_fields(fields) for _, fields in r.xrange(keys.batch_stream(MODEL, batch_id))]
    order = [int(entry.custom_id[1:]) for entry in entries]
    assert order == [0, 4, 8, 12, 16, 1, 5, 9, 13, 17, 2, 6, 10, 14, 18, 3, 7, 11, 15, 19, 20, 21, 22, 23]
    for entry in entries:
        line = json.loads(entry.line)
        assert prefixes.decode(entry.prefix) == prefix_hashes(line["prompt"], "default|")
