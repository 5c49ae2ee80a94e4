"""Structured outputs on the random-weight demo model, whose free output is gibberish:
only the constraint can make it valid. Every output that stops validates against its
JSON schema (the `jsonschema` library), matches its regex, or is one of its choices."""

from __future__ import annotations

import json
import random
import re
import time
from pathlib import Path

import jsonschema
import pytest

from engine import LLM, SamplingParams, StructuredOutputsParams

# Ten schemas: required fields, enums, array bounds, integer and number bounds, nesting, anyOf,
# string patterns, booleans and null, arrays of objects.
SCHEMAS = json.loads((Path(__file__).resolve().parents[2] / "examples" / "extraction_schemas.json").read_text())
PROMPTS = [f"Document {i}: extract the fields." for i in range(20)]


@pytest.fixture(scope="module")
def llm(demo_model):
    return LLM(demo_model, num_kv_blocks=1024, max_num_seqs=32)


def test_every_finished_output_validates_against_its_schema(llm):
    params, schemas = [], []
    for schema in SCHEMAS.values():
        for _ in PROMPTS:
            params.append(SamplingParams(temperature=0, max_tokens=96,
                                         structured_outputs=StructuredOutputsParams(json=schema)))
            schemas.append(schema)
    outputs = llm.generate(PROMPTS * len(SCHEMAS), params, use_tqdm=False)
    stopped = [(o, s) for o, s in zip(outputs, schemas) if o.finish_reason == "stop"]
    assert len(outputs) == 200 and len(stopped) >= 150, f"only {len(stopped)} of 200 completed their grammar"
    for output, schema in stopped:
        jsonschema.validate(json.loads(output.text), schema)


def test_regex_choice_and_json_object(llm):
    rng = random.Random(0)
    prompts = [f"Case {rng.random()}" for _ in range(20)]
    regex, choices = r"[A-Z]{3}-\d{4}", ["positive", "negative", "neutral"]
    kinds = [StructuredOutputsParams(regex=regex), StructuredOutputsParams(choice=choices),
             StructuredOutputsParams(json_object=True)]
    outputs = llm.generate(prompts * 3, [SamplingParams(temperature=0.8, seed=i, max_tokens=64, structured_outputs=k)
                                         for k in kinds for i in range(20)], use_tqdm=False)
    by_kind = [outputs[i * 20:(i + 1) * 20] for i in range(3)]
    assert all(o.finish_reason == "stop" and re.fullmatch(regex, o.text) for o in by_kind[0])
    assert all(o.finish_reason == "stop" and o.text in choices for o in by_kind[1])
    objects = [o for o in by_kind[2] if o.finish_reason == "stop"]
    assert objects and all(isinstance(json.loads(o.text), dict) for o in objects)


def test_unconstrained_requests_are_untouched_by_constrained_neighbours(llm):
    free = SamplingParams(temperature=0, max_tokens=24)
    alone = llm.generate(PROMPTS, free, use_tqdm=False)
    constrained = SamplingParams(temperature=0, max_tokens=48,
                                 structured_outputs=StructuredOutputsParams(json=SCHEMAS["nested"]))
    mixed = llm.generate(PROMPTS * 2, [free] * 20 + [constrained] * 20, use_tqdm=False)
    assert [o.token_ids for o in mixed[:20]] == [o.token_ids for o in alone]


def test_constraints_hold_under_preemption_and_with_n2(demo_model):
    small = LLM(demo_model, num_kv_blocks=24, max_num_seqs=16)  # 16 x ~5 blocks do not fit: preemption
    schema = SCHEMAS["array of objects"]
    params = SamplingParams(temperature=0.9, seed=3, n=2, max_tokens=60,
                            structured_outputs=StructuredOutputsParams(json=schema))
    outputs = small.generate(PROMPTS[:16], params, use_tqdm=False)
    assert small.engine.stats().num_preemptions > 0
    samples = [c for o in outputs for c in o.outputs]
    assert len(samples) == 32
    stopped = [c for c in samples if c.finish_reason == "stop"]
    assert len(stopped) >= 24
    for completion in stopped:
        jsonschema.validate(json.loads(completion.text), schema)


@pytest.mark.parametrize(("constraint", "message"), [
    ({"json": {"type": "nonsense"}}, 'structured_outputs.json: Unsupported type "nonsense"'),
    ({"regex": "[a-"}, "structured_outputs.regex: Regex parsing error at position"),
    ({"grammar": "root ::= "}, "structured_outputs.grammar:"),
    ({"json": {"type": "array", "uniqueItems": True}},
     "structured_outputs.json: not supported by the grammar compiler: /: uniqueItems:"),
])
def test_a_constraint_that_does_not_compile_is_refused_naming_it(llm, constraint, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        llm.generate(["x"], SamplingParams(structured_outputs=StructuredOutputsParams(**constraint)), use_tqdm=False)
    assert not llm.engine.has_unfinished()


def test_a_grammar_that_fails_or_outlasts_its_timeout_fails_its_request_alone(demo_model, monkeypatch):
    from engine import EngineConfig, LLMEngine, structured_outputs

    engine = LLMEngine(EngineConfig(model=demo_model, num_kv_blocks=256, max_num_seqs=8))
    compile_grammar = structured_outputs.StructuredOutputs._compile

    def compile_or_break(self, params):
        if params.regex == "broken":
            raise RuntimeError("the compiler gave up")
        if params.regex == "slow+":
            time.sleep(3)
        return compile_grammar(self, params)

    monkeypatch.setattr(structured_outputs.StructuredOutputs, "_compile", compile_or_break)
    monkeypatch.setattr(structured_outputs, "COMPILE_TIMEOUT_SECONDS", 1.0)
    regex = lambda pattern: StructuredOutputsParams(regex=pattern)  # noqa: E731
    engine.add_request("broken", "a", SamplingParams(max_tokens=8, structured_outputs=regex("broken")))
    engine.add_request("slow", "b", SamplingParams(max_tokens=8, structured_outputs=regex("slow+")))
    engine.add_request("good", "c", SamplingParams(max_tokens=8, structured_outputs=regex("[0-9]{3}")))
    engine.add_request("free", "d", SamplingParams(max_tokens=8, ignore_eos=True))
    outputs, started = {}, time.monotonic()
    while engine.has_unfinished():
        if "slow" not in outputs:  # admission never waits on a compile: only "free" and "good" wait for room
            assert engine.stats().num_waiting <= 2
        outputs.update((o.request_id, o) for o in engine.step())
    assert time.monotonic() - started < 2.9  # the slow compile was not waited for
    assert outputs["broken"].finish_reason == "error"
    assert outputs["broken"].error == "structured_outputs: the grammar did not compile: the compiler gave up"
    assert outputs["slow"].finish_reason == "error" and "within 1 s" in outputs["slow"].error
    assert re.fullmatch("[0-9]{3}", outputs["good"].text) and len(outputs["free"].token_ids) == 8


def test_the_compile_cache_is_a_bounded_lru(llm, monkeypatch):
    from engine import structured_outputs

    monkeypatch.setattr(structured_outputs, "MAX_CACHED_GRAMMARS", 2)
    for pattern in ("a{2}", "b{2}", "c{2}", "a{2}"):
        llm.generate(["x"], SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex=pattern)),
                     use_tqdm=False)
    cache = llm.engine.model_runner.structured.compiled
    assert len(cache) == 2 and list(cache)[-1] == StructuredOutputsParams(regex="a{2}").cache_key()


def test_the_bound_holds_while_grammars_compile(llm, monkeypatch):
    """Grammars still compiling count against the bound too; an evicted one still reaches its sequence."""
    import threading

    from engine import structured_outputs

    llm.generate(["x"], SamplingParams(max_tokens=1, structured_outputs=StructuredOutputsParams(regex="z")),
                 use_tqdm=False)  # the engine's StructuredOutputs exists
    structured, release = llm.engine.model_runner.structured, threading.Event()
    compile_now = structured._compile
    monkeypatch.setattr(structured_outputs, "MAX_CACHED_GRAMMARS", 2)
    monkeypatch.setattr(structured, "_compile", lambda params: release.wait(10) and compile_now(params))
    states = [structured.start(StructuredOutputsParams(regex=p)) for p in ("d{2}", "e{2}", "f{2}")]
    keys = [StructuredOutputsParams(regex=p).cache_key() for p in ("e{2}", "f{2}")]
    assert not any(state.is_ready() for state in states) and list(structured.compiled) == keys
    release.set()
    assert all(state.compiled.result(timeout=10) is not None for state in states)
