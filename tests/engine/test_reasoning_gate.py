"""A thinking model's constraint waits for its answer (SamplingParams.reasoning): the reasoning
is sampled freely, the grammar starts after the end marker, as vLLM's does; and the chat
request's markers come from its rendered prompt (workers/chat_parsers.py)."""

from __future__ import annotations

import pytest
import torch

from engine import LLMEngine, ReasoningMarkers, StructuredOutputsParams
from engine.checkpoint import load_tokenizer
from engine.config import EngineConfig
from engine.structured_outputs import StructuredOutputs
from jobs.schemas import Request
from tests.chat_models import ScriptedSampler, chat_template, write_thinking_model
from workers.chat_parsers import ChatParsers
from workers.translate import to_engine_request

REASONING = "<think>\nThe river is wide\n</think>\n\n"
YES_NO = {"choice": ["yes", "no"]}


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> LLMEngine:
    path = write_thinking_model("qwen3", tmp_path_factory.mktemp("qwen3-thinking"))
    return LLMEngine(EngineConfig(model=path, num_kv_blocks=128, max_num_seqs=4))


def chat(engine, question: str, **fields):
    body = {"messages": [{"role": "user", "content": question}], "max_tokens": 40, "temperature": 0, **fields}
    return to_engine_request(Request(custom_id="c", url="/v1/chat/completions", body=body), engine.tokenizer,
                             engine.default_sampling_params, ChatParsers("qwen3", "hermes"))


def run(engine, request) -> str:
    engine.add_request("c", request.prompt_token_ids, request.params)
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    return outputs[0].outputs[0].text


def test_a_choice_applies_after_the_reasoning_not_over_it(engine, monkeypatch):
    # The model thinks (forced, as a trained one would), then only the grammar's tokens are allowed.
    monkeypatch.setattr(engine.model_runner, "sampler", ScriptedSampler(
        engine.model_runner.sampler, engine.tokenizer, {"river": REASONING}, end=None))
    request = chat(engine, "Is the river wide?", structured_outputs=YES_NO)
    assert request.params.reasoning.initial == "undecided"
    text = run(engine, request)
    assert text.startswith("<think>\nThe river is wide\n</think>\n\n")
    assert text.removeprefix(REASONING) in ("yes", "no")


def test_with_thinking_off_the_constraint_applies_from_the_first_token(engine):
    request = chat(engine, "Is the river wide?", structured_outputs=YES_NO,
                   chat_template_kwargs={"enable_thinking": False})
    assert request.output.phase == "answer" and request.params.reasoning is None
    assert run(engine, request) in ("yes", "no")


def test_an_undecided_first_token_is_the_grammars_or_the_reasoning_start(engine):
    structured = StructuredOutputs(engine.tokenizer, engine.hf_config.vocab_size, engine.eos_token_ids)
    think = engine.tokenizer.convert_tokens_to_ids("<think>")
    end = tuple(engine.tokenizer.encode("</think>", add_special_tokens=False))
    params = StructuredOutputsParams(choice=["yes", "no"])
    free = structured.start(params)
    gated = structured.start(params, ReasoningMarkers(end, think, "undecided"))
    free.compiled.result(timeout=30)
    logits = torch.zeros(2, engine.hf_config.vocab_size)
    structured.apply_masks(logits, [free, gated])
    allowed_free = set(torch.nonzero(logits[0] == 0).flatten().tolist())
    allowed_gated = set(torch.nonzero(logits[1] == 0).flatten().tolist())
    assert think not in allowed_free and allowed_gated == allowed_free | {think}
    # Opened: the reasoning is unconstrained until </think>, then the grammar starts afresh.
    assert gated.accept(think) and gated.phase == "reasoning" and not gated.is_masked
    for token_id in engine.tokenizer.encode("any text at all", add_special_tokens=False) + list(end):
        assert gated.accept(token_id)
    assert gated.phase == "answer" and gated.is_masked and not gated.is_terminated()
    for token_id in engine.tokenizer.encode("no", add_special_tokens=False) + sorted(engine.eos_token_ids):
        assert gated.accept(token_id)
    assert gated.is_terminated()
    # Not opened: the first token is the answer's, and the grammar judges it.
    answered = structured.start(params, ReasoningMarkers(end, think, "undecided"))
    assert not answered.accept(engine.tokenizer.encode("maybe", add_special_tokens=False)[0])
    assert answered.phase == "answer"


def test_a_resumed_sequence_replays_its_reasoning_then_its_answer(engine):
    structured = StructuredOutputs(engine.tokenizer, engine.hf_config.vocab_size, engine.eos_token_ids)
    end = tuple(engine.tokenizer.encode("</think>", add_special_tokens=False))
    grammar = structured.start(StructuredOutputsParams(choice=["yes", "no"]), ReasoningMarkers(end, None, "reasoning"))
    reasoning = engine.tokenizer.encode("Let me see.</think>", add_special_tokens=False)
    grammar.replay(reasoning + engine.tokenizer.encode("ye", add_special_tokens=False))
    assert grammar.phase == "answer" and not grammar.is_terminated()
    with pytest.raises(ValueError, match="does not follow the grammar"):
        structured.start(StructuredOutputsParams(choice=["yes", "no"]), ReasoningMarkers(end, None, "reasoning")) \
            .replay(reasoning + engine.tokenizer.encode("maybe", add_special_tokens=False))


@pytest.mark.parametrize("enable_thinking, phase", [(True, "reasoning"), (False, "answer")])
def test_the_markers_follow_the_template(tmp_path, enable_thinking, phase):
    """DeepSeek-R1's template (llama.cpp's copy) opens <think> in the generation prompt, and closes
    it too with enable_thinking false: where the output begins is read from the prompt."""
    path = write_thinking_model("qwen3", tmp_path / "r1")
    (tmp_path / "r1" / "chat_template.jinja").write_text(chat_template("deepseek_r1"))
    tokenizer = load_tokenizer(path, None)
    body = {"messages": [{"role": "user", "content": "Why?"}], "structured_outputs": YES_NO,
            "chat_template_kwargs": {"enable_thinking": enable_thinking}}
    request = to_engine_request(Request(custom_id="c", url="/v1/chat/completions", body=body), tokenizer, {},
                                ChatParsers("deepseek_r1", None))
    assert tokenizer.decode(request.prompt_token_ids).endswith("<think>\n" if enable_thinking else "</think>")
    assert request.output.phase == phase
    assert (request.params.reasoning.initial if request.params.reasoning else "answer") == phase
