"""The other families' parsers through the queue with the official `openai` client: a tiny Llama
with Llama 3.1's template (llama3_json), a Mistral with Mistral-Nemo's ([TOOL_CALLS]), and a
Qwen2 with DeepSeek-R1-Distill's (deepseek_r1, chosen by flag), each forced to say what a
trained model would (tests/chat_models.ScriptedSampler); streaming and not, then the
conversation sent back, rendered by the family's own template."""

from __future__ import annotations

import json

import pytest
from openai.types.chat import ChatCompletion

from engine import EngineConfig, LLMEngine
from producers.ingest import submit
from tests.chat_models import ScriptedSampler, write_thinking_model
from tests.online.conftest import WorkerThread
from tests.workers.helpers import read_lines, wait_for_batch

TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL = ("get_weather", {"city": "Paris"})
# kind: (what the model says, its end, worker options, (reasoning, content, calls) read from it, request fields)
FAMILIES = {
    "llama3": ('{"name": "get_weather", "parameters": {"city": "Paris"}}', "<|eom_id|>", {}, (None, None, [CALL]), {}),
    "mistral": ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]', "</s>", {},
                (None, None, [CALL]), {}),
    # llama.cpp's copy of the R1 template closes <think> unless enable_thinking: here it stays open.
    "deepseek_r1": ("The river is wide\n</think>\n\nYes.", "<｜end▁of▁sentence｜>",
                    {"reasoning_parser": "deepseek_r1", "tool_call_parser": "none"}, ("The river is wide", "Yes.", []),
                    {"extra_body": {"chat_template_kwargs": {"enable_thinking": True}}}),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_engine(request, tmp_path_factory):
    kind = request.param
    path = write_thinking_model(kind, tmp_path_factory.mktemp(kind))
    engine = LLMEngine(EngineConfig(model=path, num_kv_blocks=256, max_num_seqs=8))
    script, end, *_ = FAMILIES[kind]
    engine.model_runner.sampler = ScriptedSampler(engine.model_runner.sampler, engine.tokenizer,
                                                  {"river": script}, end)
    engine.kind = kind
    return engine


@pytest.fixture
def family_worker(family_engine, redis_server, r, api):
    options = FAMILIES[family_engine.kind][2]
    with WorkerThread(family_engine, redis_server.url, name="family", served_model_names=["family"],
                      **options) as worker:
        worker._heartbeat()
        yield family_engine


def fields(message) -> tuple:
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]
    return getattr(message, "reasoning_content", None), message.content or None, calls


def test_each_family_s_answer_is_read_by_its_parser_streaming_and_not(family_worker, client):
    kind = family_worker.kind
    messages = [{"role": "user", "content": "Is the river wide?"}]
    extra = FAMILIES[kind][4]
    response = client.chat.completions.create(model="family", messages=messages, tools=[TOOL], max_tokens=80,
                                              temperature=0, **extra)
    expected = FAMILIES[kind][3]
    assert fields(response.choices[0].message) == expected
    assert response.choices[0].finish_reason == ("tool_calls" if expected[2] else "stop")
    reasoning, content, calls = "", "", []
    for chunk in client.chat.completions.create(model="family", messages=messages, tools=[TOOL], max_tokens=80,
                                                temperature=0, stream=True, **extra):
        for choice in chunk.choices:
            reasoning += getattr(choice.delta, "reasoning_content", None) or ""
            content += choice.delta.content or ""
            calls += [(c.function.name, json.loads(c.function.arguments)) for c in choice.delta.tool_calls or []]
    assert (reasoning or None, content or None, calls) == expected
    if not expected[2]:
        return
    # The answer sent back with the tool's result: the family's template renders it (Mistral's
    # takes only the 9-character ids its parser gives).
    call = response.choices[0].message.tool_calls[0]
    follow_up = messages + [response.choices[0].message.model_dump(exclude_none=True),
                            {"role": "tool", "tool_call_id": call.id, "content": "Sunny"}]
    again = client.chat.completions.create(model="family", messages=follow_up, tools=[TOOL], max_tokens=4,
                                           temperature=0)
    assert again.choices[0].finish_reason in ("stop", "length", "tool_calls")
    prompt = next(family_worker.tokenizer.decode(list(ids), skip_special_tokens=False)
                  for ids in family_worker.model_runner.sampler.by_prompt
                  if "Sunny" in family_worker.tokenizer.decode(list(ids)))
    assert '"city": "Paris"' in prompt and "Sunny" in prompt


def test_each_family_s_batch_line_is_read_by_its_parser(family_worker, r):
    kind = family_worker.kind
    extra = FAMILIES[kind][4].get("extra_body", {})
    line = {"custom_id": "q", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "family", "messages": [{"role": "user", "content": "Is the river wide?"}],
                     "tools": [TOOL], "max_tokens": 80, "temperature": 0, **extra}}
    submission = submit(r, lambda: [json.dumps(line).encode()])
    done = wait_for_batch(r, submission.batch_id)
    completion = ChatCompletion.model_validate(read_lines(r, done["output_file_id"])[0]["response"]["body"])
    assert fields(completion.choices[0].message) == FAMILIES[kind][3]
