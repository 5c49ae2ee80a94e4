"""Resumable generations in the engine (engine/resume.py): a request stopped mid-way and
added again with its progress, as another worker would after a crash, ends exactly as
the same request run without interruption: tokens, logprobs, text, finish reasons."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from engine import LLMEngine, SampleProgress, SamplingParams, StructuredOutputsParams
from engine.config import EngineConfig

SCHEMAS = json.loads((Path(__file__).resolve().parents[2] / "examples" / "extraction_schemas.json").read_text())
PROMPT = "Summarise the quarterly report of the northern region in three sentences."


@pytest.fixture(scope="module")
def engine(demo_model):
    return LLMEngine(EngineConfig(model=demo_model, num_kv_blocks=512, max_num_seqs=16))


def run(engine: LLMEngine, request_id: str, params: SamplingParams, resume=None):
    engine.add_processed_request(engine.process_request(request_id, PROMPT, params), resume=resume)
    while True:
        for output in engine.step():
            if output.request_id == request_id and output.finished:
                return output


def interrupted_at(engine: LLMEngine, request_id: str, params: SamplingParams, num_tokens: int,
                   until=None) -> list[SampleProgress]:
    """Run until every sample has `num_tokens` tokens (or `until(progress)` holds), checkpoint,
    abort: what a worker killed at that moment leaves behind; the checkpoint goes through JSON."""
    until = until or (lambda progress: all(p.finish_reason or len(p.token_ids) >= num_tokens for p in progress))
    engine.add_processed_request(engine.process_request(request_id, PROMPT, params))
    while (progress := engine.progress(request_id)) is None or not until(progress):
        assert request_id in engine.requests, "the request finished before the cut"
        engine.step()
    engine.abort(request_id)
    return [SampleProgress.from_json(json.loads(json.dumps(p.to_json()))) for p in progress]


def summary(output):
    """Tokens, text and how each sample ended: exactly. Logprobs: the same tokens, and values
    within float noise (after a resume the prefix is prefilled, where the uninterrupted run
    decoded it: other kernels, other summation orders, as after a preemption)."""
    return [(c.index, c.token_ids, c.text, c.finish_reason, c.stop_reason,
             None if c.logprobs is None else [{t: pytest.approx(v, abs=1e-4) for t, v in entry.items()}
                                              for entry in c.logprobs]) for c in output.outputs]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=40, logprobs=3),
    SamplingParams(temperature=1.0, seed=17, max_tokens=40, logprobs=2),
    SamplingParams(n=2, temperature=0.8, top_p=0.9, seed=3, max_tokens=40),
    SamplingParams(n=2, temperature=0, max_tokens=40),
], ids=["greedy", "seeded", "seeded-n2", "greedy-n2"])
@pytest.mark.parametrize("cut", [1, 17])
def test_a_resumed_request_ends_as_an_uninterrupted_one(engine, params, cut):
    expected = run(engine, "whole", params)
    progress = interrupted_at(engine, "cut", params, cut)
    assert all(len(p.token_ids) >= cut for p in progress)
    recomputed = engine.stats().num_recomputed_tokens
    resumed = run(engine, "resumed", params, resume=progress)
    assert summary(resumed) == summary(expected)
    assert not engine.requests and engine.num_free_blocks == engine.num_total_blocks
    if params.n == 1:  # what the lost worker had computed is prefilled again, less what the prefix cache held
        [sample] = progress
        lost = len(resumed.prompt_token_ids) + len(sample.token_ids) - 1
        assert engine.stats().num_recomputed_tokens - recomputed == lost - resumed.num_cached_tokens > 0


def test_an_unseeded_request_keeps_its_drawn_seed_across_a_resume(engine):
    params = SamplingParams(temperature=1.0, max_tokens=30)
    progress = interrupted_at(engine, "cut", params, 10)
    assert progress[0].sampling_seed is not None  # drawn at the first sample, kept in the checkpoint
    resumed = run(engine, "a", params, resume=progress)
    again = run(engine, "b", params, resume=progress)
    assert resumed.token_ids[:10] == progress[0].token_ids and resumed.token_ids == again.token_ids


def test_stop_strings_and_a_finished_sibling_survive_a_resume(engine):
    whole = run(engine, "probe", SamplingParams(n=2, temperature=1.0, seed=8, max_tokens=40))
    stop = whole.outputs[1].text[12:15]  # appears in sample 1's free output: a stop string ends it there
    params = SamplingParams(n=2, temperature=1.0, seed=8, max_tokens=40, stop=[stop])
    expected = run(engine, "whole", params)
    assert expected.outputs[1].stop_reason == stop
    progress = interrupted_at(engine, "cut", params, 8)
    assert summary(run(engine, "resumed", params, resume=progress)) == summary(expected)
    one_done = interrupted_at(engine, "late", params, 0, until=lambda progress: any(p.finish_reason for p in progress))
    assert [p.finish_reason for p in one_done].count(None) == 1  # a sibling still running
    assert summary(run(engine, "resumed2", params, resume=one_done)) == summary(expected)


def test_a_structured_request_replays_its_grammar(engine):
    schema = next(iter(SCHEMAS.values()))
    params = SamplingParams(temperature=0, max_tokens=96, structured_outputs=StructuredOutputsParams(json=schema))
    expected = run(engine, "whole", params)
    assert expected.finish_reason == "stop"
    jsonschema.validate(json.loads(expected.text), schema)
    progress = interrupted_at(engine, "cut", params, 20)
    assert summary(run(engine, "resumed", params, resume=progress)) == summary(expected)
    progress[0].token_ids[0] = engine.tokenizer.encode("abc", add_special_tokens=False)[0]  # JSON starts with {
    with pytest.raises(ValueError, match="does not follow the grammar"):
        run(engine, "bad", params, resume=progress)
    assert "bad" not in engine.requests


@pytest.mark.parametrize("progress, message", [
    ([SampleProgress(1, [5])], r"samples \[1\] do not match n=1"),
    ([SampleProgress(0, [5] * 40)], "has 40 tokens, max_tokens is 40"),
    ([SampleProgress(0, [10**9])], "token ids outside"),
    ([SampleProgress(0, [5, 6], logprobs=[{5: -0.1}])], "has 1 logprobs for 2 tokens"),
    ([SampleProgress(0, [5], finish_reason="length")], "every sample has finished"),
])
def test_progress_that_cannot_be_continued_is_refused(engine, progress, message):
    with pytest.raises(ValueError, match=message):
        engine.add_processed_request(engine.process_request("x", PROMPT, SamplingParams(max_tokens=40)),
                                     resume=progress)
    assert "x" not in engine.requests
