"""Prefix hashes of a request's prompt, computed where producers render it (submit, the API),
so that work sharing a prefix can be kept together and sent where that prefix is cached.

Producers do not load a tokenizer (the API and submit run without torch or the model's
files), so they cannot cut the prompt into the engine's token blocks. They hash the
rendered text instead, in fixed chunks of CHUNK_CHARS characters, each hash chained to the
one before it as the engine's block hashes are: two prompts share their first k chunk
hashes exactly when they share their first k * CHUNK_CHARS characters. 256 characters are
about 64 tokens, four KV blocks of 16. The text is what the worker will tokenize: a
completion's prompt; for a chat request its messages as canonical JSON (the chat template
is the worker's; the messages it renders come in this order). Only full chunks are
hashed, up to MAX_CHUNKS (about 1,000 tokens): beyond that, more shared text adds
little to where a request should go.

An entry carries the chain in its `prefix` field (hex, comma-separated). Submit orders a
window of a batch's lines as a trie of these chains (`group_order`), so lines that share a
prefix sit next to each other in the stream and one worker tends to pull a whole group.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

CHUNK_CHARS = 256
MAX_CHUNKS = 16


def prompt_text(body: dict[str, Any], url: str | None = None) -> str:
    """The text a request's prompt is made of, as a producer sees it (a batch line's or an
    online request's body, of endpoint `url`); empty when it has none (embeddings)."""
    if "messages" in body:
        return json.dumps(body["messages"], sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    if url == "/v1/responses":  # its instructions come first
        return json.dumps([body.get("instructions"), body["input"]], sort_keys=True, separators=(",", ":"),
                          ensure_ascii=False)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(token, int) for token in prompt):
        return ",".join(map(str, prompt))  # token ids: chunks of their text still share what they share
    return ""


def salt_of(tenant: str, body: dict[str, Any]) -> str:
    """The namespace of a request's prefix groups: as the workers' prefix caches keep apart
    what tenants (and cache_salt values) send, so do the groups that route work to them."""
    return f"{tenant}|{body.get('cache_salt') or ''}"


def prefix_hashes(text: str, salt: str = "") -> list[str]:
    """Chained 64-bit hashes (hex) of the text's full CHUNK_CHARS chunks, at most MAX_CHUNKS;
    the first chained to `salt`."""
    hashes, previous = [], salt.encode()
    for start in range(0, min(len(text) // CHUNK_CHARS, MAX_CHUNKS) * CHUNK_CHARS, CHUNK_CHARS):
        digest = hashlib.blake2b(previous + text[start:start + CHUNK_CHARS].encode(), digest_size=8).digest()
        hashes.append(digest.hex())
        previous = digest
    return hashes


def encode(hashes: list[str]) -> str:
    return ",".join(hashes)


def decode(field: str | bytes | None) -> list[str]:
    if not field:
        return []
    return (field.decode() if isinstance(field, bytes) else field).split(",")


def group_order(chains: list[list[str]]) -> list[int]:
    """Indexes of `chains` (one per line of a window, in file order) in trie order: lines
    sharing their first chunk together, and within them those sharing the second, and so
    on; groups in the order of their first line, each line after the lines it follows in
    the file where nothing is shared. A window without shared prefixes keeps its order."""
    first_seen: dict[str, int] = {}
    keys = []
    for index, chain in enumerate(chains):
        keys.append(tuple(first_seen.setdefault(h, index) for h in chain) + (index,))
    return sorted(range(len(chains)), key=keys.__getitem__)
