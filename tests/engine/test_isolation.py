"""A step that one request breaks fails that request alone (engine/isolation.py): its
neighbours produce exactly the tokens they produce without it; a failure no request explains
is StepFailed, with nothing of the step committed."""

from __future__ import annotations

import pytest

from engine import EmbeddingEngine, EngineConfig, LLMEngine, SamplingParams, StepFailed, create_engine
from engine.isolation import isolate_failures

POISON_SEED = 666


class PoisonedSampler:
    """The engine's sampler, raising on any step that samples a row of the poisoned request
    (as a value the sampler cannot take would)."""

    def __init__(self, sampler, is_poisoned) -> None:
        self.sampler, self.is_poisoned, self.num_calls = sampler, is_poisoned, 0

    def __call__(self, logits, rows):
        self.num_calls += 1
        if any(self.is_poisoned(row) for row in rows):
            raise OverflowError("Overflow when unpacking long long")
        return self.sampler(logits, rows)


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return LLMEngine(EngineConfig(model=tiny_llama, num_kv_blocks=64, max_num_seqs=8))


def run_all(engine) -> dict:
    outputs = {}
    while engine.has_unfinished():
        outputs.update((o.request_id, o) for o in engine.step())
    return outputs


def add_requests(engine, num: int, poisoned: set[int] = frozenset(), **params) -> None:
    for i in range(num):
        seed = POISON_SEED if i in poisoned else i
        engine.add_request(f"r{i}", [3 + i, 7, 11 + i, 5] * (1 + i % 3),
                           SamplingParams(max_tokens=6, temperature=0.8, seed=seed, **params))


@pytest.mark.parametrize("poisoned", [{0}, {5}, {2, 6}])
def test_a_poisoned_request_fails_alone_and_its_neighbours_are_unchanged(engine, monkeypatch, poisoned):
    add_requests(engine, 8, poisoned=set())
    expected = run_all(engine)
    sampler = engine.model_runner.sampler
    monkeypatch.setattr(engine.model_runner, "sampler",
                        PoisonedSampler(sampler, lambda row: row.params.seed == POISON_SEED))
    add_requests(engine, 8, poisoned=poisoned)
    outputs = run_all(engine)
    assert sorted(outputs) == sorted(expected)
    for request_id, output in outputs.items():
        if int(request_id[1:]) in poisoned:
            assert (output.error_code, output.finish_reason, output.token_ids) == ("engine_error", "error", [])
            assert "OverflowError: Overflow when unpacking long long" in output.error
        else:
            assert output.error is None
            assert (output.token_ids, output.finish_reason) == (expected[request_id].token_ids,
                                                                expected[request_id].finish_reason)
    assert engine.num_free_blocks == engine.num_total_blocks  # nothing leaked by the failed steps


def test_a_failure_of_every_request_is_step_failed_and_nothing_is_committed(engine, monkeypatch):
    sampler = engine.model_runner.sampler
    monkeypatch.setattr(engine.model_runner, "sampler", PoisonedSampler(sampler, lambda row: True))
    add_requests(engine, 3)
    with pytest.raises(StepFailed, match="each of its 3 requests alone"):
        engine.step()
    assert all(engine.num_output_tokens(f"r{i}") == 0 for i in range(3))
    for i in range(3):  # the caller hands them back: the engine is clean after
        engine.abort(f"r{i}")
    assert not engine.has_unfinished() and engine.num_free_blocks == engine.num_total_blocks


def test_a_lone_request_is_tried_again_before_it_is_blamed(engine, monkeypatch):
    add_requests(engine, 1)
    expected = run_all(engine)["r0"].token_ids
    failures = iter([True])  # the first call fails, every later one passes: a transient failure
    sampler = engine.model_runner.sampler
    monkeypatch.setattr(engine.model_runner, "sampler",
                        PoisonedSampler(sampler, lambda row: next(failures, False)))
    add_requests(engine, 1)
    output = run_all(engine)["r0"]
    assert output.error is None and output.token_ids == expected


def test_n_samples_of_a_poisoned_request_all_end_and_free_their_blocks(engine, monkeypatch):
    """Samples forked in the failing step (n > 1) go with their request."""
    sampler = engine.model_runner.sampler
    monkeypatch.setattr(engine.model_runner, "sampler",
                        PoisonedSampler(sampler, lambda row: row.params.seed == POISON_SEED))
    engine.add_request("forked", [4, 5, 6] * 7, SamplingParams(n=3, max_tokens=4, temperature=1, seed=POISON_SEED))
    engine.add_request("fine", [9, 8, 7], SamplingParams(n=2, max_tokens=4, temperature=1, seed=1))
    outputs = run_all(engine)
    assert outputs["forked"].error_code == "engine_error"
    assert outputs["fine"].error is None and [len(c.token_ids) for c in outputs["fine"].outputs] == [4, 4]
    assert engine.num_free_blocks == engine.num_total_blocks


def test_bisection_runs_each_part_once_and_names_every_fault():
    runs = []

    def run(keys):
        runs.append(list(keys))
        if {"c", "f"} & set(keys):
            raise ValueError(f"bad {sorted({'c', 'f'} & set(keys))}")

    at_fault = isolate_failures(list("abcdefgh"), run, ValueError("first"))
    assert sorted(at_fault) == ["c", "f"] and str(at_fault["c"]) == "bad ['c']"
    committed = [key for keys in runs if not {"c", "f"} & set(keys) for key in keys]
    assert sorted(committed) == list("abdegh")  # every other key ran exactly once


def test_embedding_step_fails_only_the_poisoned_request(tmp_path, tiny_tokenizer, monkeypatch):
    from tests.embedding_models import write_embedding_checkpoint  # noqa: PLC0415

    folder = write_embedding_checkpoint("bert", tmp_path / "bert", tiny_tokenizer)
    engine = create_engine(EngineConfig(model=str(folder), max_num_batched_tokens=512))
    assert isinstance(engine, EmbeddingEngine)
    engine.add_request("a", ["first input", "second input"])
    engine.add_request("b", ["third"])
    expected = run_all(engine)
    embed = engine.model_runner.embed

    def poisoned_embed(token_ids, pooling_type):
        if any(ids == expected["b"].prompt_token_ids[0] for ids in token_ids):
            raise RuntimeError("index out of range")
        return embed(token_ids, pooling_type)

    monkeypatch.setattr(engine.model_runner, "embed", poisoned_embed)
    engine.add_request("a", ["first input", "second input"])
    engine.add_request("b", ["third"])
    outputs = run_all(engine)
    assert outputs["b"].error_code == "engine_error" and outputs["b"].outputs == []
    assert outputs["a"].error is None
    assert [o.embedding for o in outputs["a"].outputs] == [o.embedding for o in expected["a"].outputs]
