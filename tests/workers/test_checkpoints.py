"""Resumable batch generations in the worker loop (workers/lanes.py: checkpoint): a worker
that dies mid-generation leaves its requests' tokens in Redis, and the worker that takes the
entries over continues them. Outputs equal an uninterrupted run's, and the tokens
generated twice are bounded by the checkpoint interval."""

from __future__ import annotations

import time

import pytest

from engine import LLM, EngineConfig, LLMEngine, SamplingParams
from jobs import keys
from tests.workers.helpers import completion, make_worker, read_lines, run_until, submit_lines
from workers import checkpoints

EVERY = 8  # --checkpoint-tokens


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return LLMEngine(EngineConfig(model=tiny_llama, num_kv_blocks=128, max_num_seqs=8))


def records(n: int) -> list[dict]:
    """Long enough that a crash lands mid-generation: greedy, seeded, and n=2 with logprobs."""
    extra = [{}, {"temperature": 0.9, "seed": 4}, {"n": 2, "temperature": 1.0, "seed": 9, "logprobs": 2}]
    return [completion(f"c{i}", f"The ledger of night {i} says" + " again" * i, max_tokens=60, ignore_eos=True,
                       **extra[i % 3]) for i in range(n)]


def checkpoint_keys(batch_id: str, n: int) -> list[str]:
    return [keys.checkpoint(batch_id, f"c{i}") for i in range(n)]


def test_a_worker_killed_mid_generation_is_continued_by_the_next(engine, r, tiny_llama):
    lines = records(6)
    batch_id = submit_lines(r, lines)
    dying = make_worker(engine, r, name="w-dying", lease_seconds=1, checkpoint_tokens=EVERY)
    while not all(r.exists(key) for key in checkpoint_keys(batch_id, 6)):
        dying.run_once()
    for _ in range(3):  # a few steps past the checkpoints: tokens the crash throws away
        dying.run_once()
    saved = {key: checkpoints.load_many(r, [key])[0] for key in checkpoint_keys(batch_id, 6)}
    generated = sum(engine.num_output_tokens(rid) for rid in dying.batch_lane.in_flight)
    lost = generated - sum(len(sample.token_ids) for progress in saved.values() for sample in progress)
    # Counted per step, as vLLM does: the dying worker's counters hold what it did, though nothing finished.
    assert dying.metrics.generation_tokens["batch"]._value.get() == generated
    assert dying.metrics.prompt_tokens["batch"]._value.get() == sum(
        len(work.processed.prompt_token_ids) for work in dying.batch_lane.in_flight.values())
    # kill -9: nothing acked, nothing handed back, no lease renewed any more
    dying.leases.stop()
    for lane in dying.lanes:
        lane.release()
    time.sleep(1.2)  # past the lease

    heir = make_worker(engine, r, name="w-heir", lease_seconds=1, checkpoint_tokens=EVERY)
    done = run_until(heir, r, [batch_id])[batch_id]
    assert done["request_counts"] == {"total": 6, "completed": 6, "failed": 0}
    resumed_tokens = heir.metrics.resumed_tokens._value.get()
    assert resumed_tokens == sum(len(s.token_ids) for progress in saved.values() for s in progress) > 0
    assert heir.metrics.resumed_requests._value.get() == 6
    assert 0 <= lost <= 6 * 2 * EVERY  # at most one interval per sample is generated twice
    outputs = sum(line["response"]["body"]["usage"]["completion_tokens"]
                  for line in read_lines(r, done["output_file_id"]))
    sampled = dying.metrics.generation_tokens["batch"]._value.get() + heir.metrics.generation_tokens["batch"]._value.get()
    assert sampled - outputs == lost  # the fleet's counters show exactly the tokens generated twice
    assert not any(r.exists(key) for key in checkpoint_keys(batch_id, 6))  # deleted once finished

    expected = uninterrupted(tiny_llama, lines)
    got = {line["custom_id"]: line["response"]["body"] for line in read_lines(r, done["output_file_id"])}
    for custom_id, choices in expected.items():
        assert [choice_of(c) for c in got[custom_id]["choices"]] == choices, custom_id


def test_a_drained_worker_checkpoints_everything_it_hands_back(engine, r, tiny_llama):
    lines = records(3)
    batch_id = submit_lines(r, lines)
    draining = make_worker(engine, r, name="w-drain", checkpoint_tokens=1000)  # no periodic checkpoint
    while sum(engine.num_output_tokens(rid) for rid in draining.batch_lane.in_flight) < 30:
        draining.run_once()
    generated = {work.custom_id: engine.num_output_tokens(rid) for rid, work in draining.batch_lane.in_flight.items()}
    draining.batch_lane.hand_back()
    saved = {custom_id: checkpoints.load_many(r, [keys.checkpoint(batch_id, custom_id)])[0] for custom_id in generated}
    assert {c: sum(len(s.token_ids) for s in progress) for c, progress in saved.items()} == generated
    draining.leases.stop()

    heir = make_worker(engine, r, name="w-heir2", checkpoint_tokens=1000)
    done = run_until(heir, r, [batch_id])[batch_id]
    assert heir.metrics.resumed_tokens._value.get() == sum(generated.values())
    got = {line["custom_id"]: line["response"]["body"] for line in read_lines(r, done["output_file_id"])}
    for custom_id, choices in uninterrupted(tiny_llama, lines).items():
        assert [choice_of(c) for c in got[custom_id]["choices"]] == choices


def test_sigterm_with_drain_mode_migrate_hands_everything_back_at_once(engine, r, tiny_llama):
    """--drain-mode migrate: the stopped worker finishes nothing; it checkpoints and hands back
    every running request in one turn and exits 0; another worker completes the batch, once,
    with the outputs of an uninterrupted run."""
    lines = records(6)
    batch_id = submit_lines(r, lines)
    migrating = make_worker(engine, r, name="w-migrate", drain_mode="migrate", drain_seconds=60,
                            checkpoint_tokens=1000)  # no periodic checkpoint: only the hand-back's
    while sum(engine.num_output_tokens(rid) for rid in migrating.batch_lane.in_flight) < 40:
        migrating.run_once()
    generated = {work.custom_id: engine.num_output_tokens(rid) for rid, work in migrating.batch_lane.in_flight.items()}
    assert len(generated) == 6 and all(0 < n < 60 for n in generated.values())
    migrating.request_stop()  # what the SIGTERM handler does
    started = time.monotonic()
    assert migrating.work() == 0
    assert time.monotonic() - started < 2.0
    assert not engine.has_unfinished() and not migrating.batch_lane.in_flight
    pending = sum(r.xpending(stream, keys.CONSUMER_GROUP)["pending"] for stream in migrating.batch_lane.streams)
    assert pending == 0  # handed back, not left to a lease
    saved = {c: checkpoints.load_many(r, [keys.checkpoint(batch_id, c)])[0] for c in generated}
    assert {c: sum(len(s.token_ids) for s in progress) for c, progress in saved.items()} == generated

    heir = make_worker(engine, r, name="w-heir3", checkpoint_tokens=1000)
    done = run_until(heir, r, [batch_id])[batch_id]
    assert done["request_counts"] == {"total": 6, "completed": 6, "failed": 0}
    assert heir.metrics.resumed_tokens._value.get() == sum(generated.values())
    got = [line for line in read_lines(r, done["output_file_id"])]
    assert sorted(line["custom_id"] for line in got) == [f"c{i}" for i in range(6)]  # each exactly once
    expected = uninterrupted(tiny_llama, lines)
    for line in got:
        assert [choice_of(c) for c in line["response"]["body"]["choices"]] == expected[line["custom_id"]]


def choice_of(choice: dict) -> tuple[str, list[float] | None]:
    """A result line's choice: its text and its tokens' logprobs."""
    return choice["text"], (choice["logprobs"] or {}).get("token_logprobs")


def uninterrupted(model: str, lines: list[dict]) -> dict[str, list]:
    """Each line's choices (text, logprobs) run without interruption by LLM.generate."""
    llm = LLM(model, num_kv_blocks=128)
    out = {}
    for line in lines:
        params = SamplingParams(max_tokens=line["max_tokens"], temperature=line["temperature"], ignore_eos=True,
                                seed=line.get("seed"), n=line.get("n", 1), logprobs=line.get("logprobs"))
        output = llm.generate([line["prompt"]], params, use_tqdm=False)[0]
        # Logprobs within float noise: a resumed prefix is prefilled where this run decoded it.
        out[line["custom_id"]] = [(c.text, None if c.logprobs is None else pytest.approx(
            [entry[t] for entry, t in zip(c.logprobs, c.token_ids)], abs=1e-4)) for c in output.outputs]
    return out


def test_prefix_cache_counters_follow_the_engine_in_tokens(engine, r):
    """vLLM's prefix_cache_queries / prefix_cache_hits, in tokens, from the heartbeat's stats:
    lines sharing a 64-token prefix hit it once the first has run."""
    shared = " ".join(f"w{i}" for i in range(60))
    worker = make_worker(engine, r, name="w-prefix")
    before = engine.stats()
    first = submit_lines(r, [completion("p0", f"{shared} and then 0", max_tokens=2)])
    run_until(worker, r, [first])  # its blocks are cached once it has run: the next three find them
    rest = submit_lines(r, [completion(f"p{i}", f"{shared} and then {i}", max_tokens=2) for i in range(1, 4)])
    run_until(worker, r, [rest])
    worker._heartbeat()
    after = engine.stats()
    queries, hits = worker.metrics.prefix_cache_queries._value.get(), worker.metrics.prefix_cache_hits._value.get()
    assert (queries, hits) == (after.num_prefix_queried_tokens, after.num_prefix_hit_tokens)
    assert hits - before.num_prefix_hit_tokens >= 3 * 48  # three later lines found 3+ shared blocks each
