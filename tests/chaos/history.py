"""The history checker every chaos scenario ends with: from the batch's own files and
counters, nothing lost, nothing doubled, counts and usage right."""

from __future__ import annotations

from collections import Counter

from jobs import batches
from tests.workers.helpers import read_lines


def check_history(r, expected: dict[str, set[str]], allow_failed: bool = False) -> dict[str, dict]:
    """`expected`: batch id -> the custom ids it was given. Every id must end in exactly
    one line of the output or error file and in the done set; nothing else may appear;
    request_counts and usage must equal what the lines say. Returns each batch object."""
    objects = {}
    for batch_id, custom_ids in expected.items():
        batch = batches.batch_object(r, batch_id)
        assert batch["status"] in batches.TERMINAL, (batch_id, batch["status"])
        outputs = read_lines(r, batch["output_file_id"])
        errors = read_lines(r, batch["error_file_id"])
        seen = Counter(line["custom_id"] for line in outputs + errors)
        doubled = sorted(custom_id for custom_id, count in seen.items() if count > 1)
        lost = sorted(custom_ids - set(seen))
        unknown = sorted(set(seen) - custom_ids)
        assert (lost, doubled, unknown) == ([], [], []), f"{batch_id}: lost {lost}, doubled {doubled}, " \
                                                         f"unknown {unknown}"
        assert batches.counted_ids(r, batch_id) == custom_ids
        lines = {"total": len(custom_ids), "completed": len(outputs), "failed": len(errors)}
        assert batch["request_counts"] == lines, f"{batch_id}: request_counts {batch['request_counts']}, lines {lines}"
        if not allow_failed:
            assert errors == [], errors[:3]
        usage = [line["response"]["body"]["usage"] for line in outputs]
        if usage:
            assert batch["usage"]["input_tokens"] == sum(u["prompt_tokens"] for u in usage)
            assert batch["usage"]["output_tokens"] == sum(u["completion_tokens"] for u in usage)
        objects[batch_id] = batch
    return objects
