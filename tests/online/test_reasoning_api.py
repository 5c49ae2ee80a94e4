"""Thinking and tool-calling models through the queue, with the official `openai` client: a
tiny Qwen3 (qwen3 + hermes parsers) and gpt-oss (gpt_oss + openai) whose outputs are forced to
think, answer and call a tool (tests/chat_models.ScriptedSampler); the parsed fields equal
what the text says, streaming and not, in chat completions and the Responses API."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from openai.types.chat import ChatCompletion
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from engine import EngineConfig, LLMEngine
from producers.ingest import submit
from tests.chat_models import ScriptedSampler, write_thinking_model
from tests.online.conftest import WorkerThread
from tests.workers.helpers import read_lines, wait_for_batch

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"], "additionalProperties": False}}}
SCRIPTS = {
    "qwen3": ({"river": '<think>\nThe river is wide\n</think>\n\nAnswer: yes\n<tool_call>\n'
                        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
               "capital": "<think>\nEasy.\n</think>\n\nParis.", "Anything": ("<think>\nOK.\n</think>\n\n", None)},
              "<|im_end|>", "<think>\nThe river is wide\n</think>"),
    "gpt_oss": ({"river": "<|channel|>analysis<|message|>The river is wide<|end|><|start|>assistant<|channel|>final"
                          "<|message|>Answer: yes<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather"
                          ' <|constrain|>json<|message|>{"city": "Paris"}<|call|>',
                 "capital": "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final"
                            "<|message|>Paris.<|return|>",
                 "Anything": ("<|channel|>analysis<|message|>OK.<|end|><|start|>assistant<|channel|>final<|message|>",
                              None)}, "<|return|>",
                "<|channel|>analysis<|message|>The river is wide<|end|>"),
}
CITY_TOOL = {"type": "function", "function": {  # short outputs: a forced call ends well within max_tokens
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Lyon"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
EXPECTED = {"reasoning": "The river is wide", "content": "Answer: yes", "call": ("get_weather", {"city": "Paris"})}


@pytest.fixture(scope="module", params=["qwen3", "gpt_oss"])
def thinking_engine(request, tmp_path_factory):
    kind = request.param
    path = write_thinking_model(kind, tmp_path_factory.mktemp(kind))
    engine = LLMEngine(EngineConfig(model=path, num_kv_blocks=256, max_num_seqs=8))
    scripts, end, reasoning_text = SCRIPTS[kind]
    engine.model_runner.sampler = ScriptedSampler(engine.model_runner.sampler, engine.tokenizer, scripts, end)
    engine.kind = kind
    engine.expected_reasoning_tokens = len(engine.tokenizer.encode(reasoning_text, add_special_tokens=False))
    return engine


@pytest.fixture
def thinker(thinking_engine, redis_server, r, api):
    with WorkerThread(thinking_engine, redis_server.url, name="thinker", served_model_names=["thinker"]) as worker:
        worker._heartbeat()
        yield thinking_engine


def ask(client, question: str, **fields):
    fields = {"max_tokens": 120, "temperature": 0, **fields}
    return client.chat.completions.create(model="thinker", messages=[{"role": "user", "content": question}],
                                          **fields)


def content_of(text: str | None) -> str | None:
    return text.strip() if text else text


def test_a_thinking_answer_with_a_tool_call(thinker, client):
    response = ask(client, "Is the river wide?", tools=[WEATHER_TOOL])
    choice = choice_fields(response.choices[0].message)
    assert choice == (EXPECTED["reasoning"], EXPECTED["content"], [EXPECTED["call"]])
    assert response.choices[0].finish_reason == "tool_calls"
    assert response.choices[0].message.tool_calls[0].id.startswith("call_")
    assert response.usage.completion_tokens_details.reasoning_tokens == thinker.expected_reasoning_tokens


def choice_fields(message):
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]
    return getattr(message, "reasoning_content", None), content_of(message.content), calls


def test_the_stream_says_the_same_in_deltas(thinker, client):
    stream = ask(client, "Is the river wide?", tools=[WEATHER_TOOL], stream=True,
                 stream_options={"include_usage": True})
    reasoning, content, calls, finish, usage = "", "", [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            reasoning += getattr(choice.delta, "reasoning_content", None) or ""  # vLLM's field, beside OpenAI's
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                assert call.id.startswith("call_") and call.type == "function" and call.index == len(calls)
                calls.append((call.function.name, json.loads(call.function.arguments)))
            finish = choice.finish_reason or finish
    assert (reasoning, content.strip(), calls) == (EXPECTED["reasoning"], EXPECTED["content"], [EXPECTED["call"]])
    assert finish == "tool_calls"
    assert usage.completion_tokens_details.reasoning_tokens == thinker.expected_reasoning_tokens


def test_without_tools_the_call_is_text_and_an_answer_alone_is_content(thinker, client):
    plain = ask(client, "What is the capital of France?")
    assert (plain.choices[0].message.reasoning_content, plain.choices[0].message.content) == ("Easy.", "Paris.")
    assert plain.choices[0].finish_reason == "stop" and plain.choices[0].message.tool_calls is None


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_tool_choice_is_a_call_valid_for_its_schema(thinker, client, tool_choice):
    response = ask(client, "Anything at all?", tools=[CITY_TOOL], tool_choice=tool_choice,
                   parallel_tool_calls=False, max_tokens=300)
    message = response.choices[0].message  # the model thinks (forced), then the grammar writes the call
    assert getattr(message, "reasoning_content", None) == "OK."
    assert message.content is None and len(message.tool_calls) == 1
    assert message.tool_calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(message.tool_calls[0].function.arguments), CITY_TOOL["function"]["parameters"])
    assert response.choices[0].finish_reason == "tool_calls"


def test_a_conversation_with_tool_results_and_template_options(thinker, client):
    messages = [{"role": "user", "content": "Is the river wide?"},
                {"role": "assistant", "content": None, "reasoning_content": "Check the weather.",
                 "tool_calls": [{"id": "call_1", "type": "function",
                                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"}]
    extra = {"reasoning_effort": "high"} if thinker.kind == "gpt_oss" else \
        {"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}
    response = client.chat.completions.create(model="thinker", messages=messages, tools=[WEATHER_TOOL],
                                              max_tokens=120, temperature=0, **extra)
    prompts = [thinker.tokenizer.decode(list(ids), skip_special_tokens=False)
               for ids in thinker.model_runner.sampler.by_prompt]
    prompt = next(prompt for prompt in prompts if "Sunny" in prompt)
    reasoning, content, calls = choice_fields(response.choices[0].message)
    assert calls == [EXPECTED["call"]]
    if thinker.kind == "gpt_oss":
        assert "Reasoning: high" in prompt and "<|start|>functions.get_weather to=assistant<|channel|>commentary" \
            '<|message|>"Sunny, 21 C"<|end|>' in prompt
        assert (reasoning, content) == (EXPECTED["reasoning"], EXPECTED["content"])
    else:  # enable_thinking false: the template closed the reasoning; what the model says is all answer
        assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
        assert "<tool_response>\nSunny, 21 C\n</tool_response>" in prompt
        assert reasoning is None and content.startswith("<think>\nThe river is wide\n</think>")


def test_the_responses_api_answers_in_output_items(thinker, client):
    response = client.responses.create(model="thinker", input="Is the river wide?", instructions="Be brief.",
                                       tools=[{"type": "function", **WEATHER_TOOL["function"]}],
                                       max_output_tokens=120, temperature=0)
    Response.model_validate(response.to_dict())  # strictly OpenAI's type (the client's parse is lenient)
    assert [item.type for item in response.output] == ["reasoning", "message", "function_call"]
    assert response.output[0].content[0].text == EXPECTED["reasoning"]
    assert response.output_text.strip() == EXPECTED["content"]
    call = response.output[2]
    assert (call.name, json.loads(call.arguments)) == EXPECTED["call"] and call.call_id.startswith("call_")
    assert response.status == "completed" and response.instructions == "Be brief."
    assert response.usage.output_tokens_details.reasoning_tokens == thinker.expected_reasoning_tokens
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens


def test_the_responses_stream_builds_the_same_response(thinker, client):
    events = list(client.responses.create(model="thinker", input="Is the river wide?", stream=True,
                                          tools=[{"type": "function", **WEATHER_TOOL["function"]}],
                                          max_output_tokens=120, temperature=0))
    for event in events:  # each strictly one of OpenAI's stream event types
        TypeAdapter(ResponseStreamEvent).validate_python(event.to_dict())
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    final = events[-1].response
    assert [item.type for item in final.output] == ["reasoning", "message", "function_call"]
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output[1].content[0].text and deltas.strip() == EXPECTED["content"]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == EXPECTED["reasoning"]
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [(e.name, json.loads(e.arguments)) for e in done] == [EXPECTED["call"]]
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    assert added == ["reasoning", "message", "function_call"]


def test_the_responses_api_refuses_what_it_cannot_honour(thinker, client):
    with pytest.raises(openai.BadRequestError, match="does not store responses"):
        client.responses.create(model="thinker", input="Hi", previous_response_id="resp_1")
    with pytest.raises(openai.BadRequestError, match="no tool named 'nope'"):
        client.responses.create(model="thinker", input="Hi", tools=[{"type": "function", **WEATHER_TOOL["function"]}],
                                tool_choice={"type": "function", "name": "nope"})


def test_responses_lines_through_the_batches_api_and_chat_lines_through_submit(thinker, client, r, api):
    tool = {"type": "function", **WEATHER_TOOL["function"]}
    lines = [{"custom_id": "river", "method": "POST", "url": "/v1/responses",
              "body": {"model": "thinker", "input": [{"role": "user", "content": "Is the river wide?"}],
                       "tools": [tool], "max_output_tokens": 120, "temperature": 0}},
             {"custom_id": "capital", "method": "POST", "url": "/v1/responses",
              "body": {"model": "thinker", "input": "What is the capital of France?", "instructions": "Be brief.",
                       "max_output_tokens": 120, "temperature": 0}}]
    upload = client.files.create(file=("responses.jsonl", "\n".join(map(json.dumps, lines)).encode()),
                                 purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/responses", completion_window="24h")
    done = wait_for_batch(r, batch.id)
    assert done["status"] == "completed" and done["request_counts"]["completed"] == 2, done
    results = {line["custom_id"]: line for line in map(json.loads, client.files.content(
        done["output_file_id"]).text.splitlines())}
    river = Response.model_validate(results["river"]["response"]["body"])  # OpenAI's own type
    assert [item.type for item in river.output] == ["reasoning", "message", "function_call"]
    assert (river.output[0].content[0].text, river.output_text.strip()) == (EXPECTED["reasoning"],
                                                                            EXPECTED["content"])
    assert (river.output[2].name, json.loads(river.output[2].arguments)) == EXPECTED["call"]
    assert river.usage.output_tokens_details.reasoning_tokens == thinker.expected_reasoning_tokens
    reasoning_tokens = sum(line["response"]["body"]["usage"]["output_tokens_details"]["reasoning_tokens"]
                           for line in results.values())
    assert client.batches.retrieve(batch.id).usage.output_tokens_details.reasoning_tokens == reasoning_tokens
    page = httpx.get(f"{api.url}/ui/batches/{batch.id}").text  # the console's batch page says it too
    assert f"({reasoning_tokens} reasoning)" in page
    capital = Response.model_validate(results["capital"]["response"]["body"])
    assert (capital.output[0].content[0].text, capital.output_text, capital.instructions) == (
        "Easy.", "Paris.", "Be brief.")
    chat_lines = [json.dumps({"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions", "body": {
        "model": "thinker", "messages": [{"role": "user", "content": "Is the river wide?"}], "tools": [WEATHER_TOOL],
        "max_tokens": 120, "temperature": 0}}).encode()]
    for lines_of_endpoint, check in ((chat_lines, None), ([json.dumps(lines[0]).encode()], "responses")):
        submission = submit(r, lambda lines_of_endpoint=lines_of_endpoint: lines_of_endpoint)
        assert submission.accepted
        body = read_lines(r, wait_for_batch(r, submission.batch_id)["output_file_id"])[0]["response"]["body"]
        if check == "responses":  # the same Responses line through producers.submit
            submitted = Response.model_validate(body)
            assert [item.type for item in submitted.output] == ["reasoning", "message", "function_call"]
            assert submitted.output_text == river.output_text
        else:
            completion = ChatCompletion.model_validate(body)
    assert choice_fields(completion.choices[0].message) == (EXPECTED["reasoning"], EXPECTED["content"],
                                                            [EXPECTED["call"]])
    assert completion.choices[0].finish_reason == "tool_calls"


def test_a_responses_text_format_constrains_the_answer_after_the_reasoning(thinker, client):
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Lyon"]}}, "required": ["city"],
              "additionalProperties": False}
    response = client.responses.create(model="thinker", input="Anything at all?", max_output_tokens=200,
                                       temperature=0, text={"format": {"type": "json_schema", "name": "city",
                                                                       "schema": schema, "strict": True}})
    assert response.output[0].type == "reasoning" and response.output[0].content[0].text == "OK."
    jsonschema.validate(json.loads(response.output_text), schema)
    assert response.text.format.type == "json_schema" and response.text.format.name == "city"


def test_the_sdks_stream_helper_assembles_the_same_response(thinker, client):
    """openai's `responses.stream()` folds the events into a Response as it goes, checking their order."""
    with client.responses.stream(model="thinker", input="Is the river wide?", temperature=0,
                                 tools=[{"type": "function", **WEATHER_TOOL["function"]}],
                                 max_output_tokens=120) as stream:
        texts = [event.delta for event in stream if event.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(texts) == final.output_text and final.output_text.strip() == EXPECTED["content"]
    assert [item.type for item in final.output] == ["reasoning", "message", "function_call"]
    assert (final.output[2].name, json.loads(final.output[2].arguments)) == EXPECTED["call"]
