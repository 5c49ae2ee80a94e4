"""Reasoning and tool parsers (jobs/reasoning.py, jobs/tool_calls.py, jobs/harmony.py) on the
texts their models write: the parsed fields equal what the text says, and a stream, whatever
its cut into deltas, sends exactly the final parse."""

from __future__ import annotations

import json
import random
import re

import pytest

from jobs.chat_output import OutputFormat, StreamedMessage, chat_message, parse_message
from jobs.harmony import parse_harmony

WEATHER = {"city": "Paris", "unit": "celsius"}
CASES = {
    "qwen3 thinking, an answer and two calls": (
        OutputFormat("qwen3", "hermes", phase="undecided"),
        "<think>\nThe river is wide.\nIt is 3 km.\n</think>\n\nAnswer: yes\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>\n<tool_call>\n'
        '{"name": "get_time", "arguments": {}}\n</tool_call>',
        ("The river is wide.\nIt is 3 km.", "Answer: yes\n", [("get_weather", WEATHER), ("get_time", {})])),
    "qwen3 with thinking off (the prompt closed it)": (
        OutputFormat("qwen3", None, phase="answer"), "Answer: <think> is plain text here",
        (None, "Answer: <think> is plain text here", [])),
    "qwen3 answering without thinking": (
        OutputFormat("qwen3", "hermes", phase="undecided"), "No need to think.", (None, "No need to think.", [])),
    "deepseek_r1: the prompt opened <think>": (
        OutputFormat("deepseek_r1", None, phase="reasoning"), "Let me see.\n</think>\n\n42",
        ("Let me see.", "42", [])),
    "thinking cut off by max_tokens": (
        OutputFormat("qwen3", None, phase="undecided"), "<think>\nStill thinking about </thi",
        ("Still thinking about </thi", "", [])),
    "gpt-oss analysis then final": (
        OutputFormat("gpt_oss", "openai", phase="reasoning"),
        "<|channel|>analysis<|message|>Simple sum.<|end|><|start|>assistant<|channel|>final<|message|>"
        "It is 5050.<|return|>", ("Simple sum.", "It is 5050.", [])),
    "gpt-oss: a preamble and a call": (
        OutputFormat("gpt_oss", "openai", phase="reasoning"),
        "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary<|message|>"
        "Checking.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"city": "Paris", "unit": "celsius"}<|call|>',
        ("Need weather.", "Checking.", [("get_weather", WEATHER)])),
    "llama3_json": (
        OutputFormat(None, "llama3_json"),
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
        '{"name": "get_time", "parameters": {}}', (None, "", [("get_weather", WEATHER), ("get_time", {})])),
    "llama3_json: JSON that is not a call stays text": (
        OutputFormat(None, "llama3_json"), '{"answer": 42}', (None, '{"answer": 42}', [])),
    "mistral, a list of calls": (
        OutputFormat(None, "mistral"),
        'Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]',
        (None, "Sure. ", [("get_weather", WEATHER)])),
    "mistral v11: name[ARGS]{...}": (
        OutputFormat(None, "mistral"),
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}[TOOL_CALLS]get_time[ARGS]{}</s>',
        (None, "", [("get_weather", WEATHER), ("get_time", {})])),
    "a forced function: the text is its arguments": (
        OutputFormat("qwen3", None, forced_tool="get_weather", phase="undecided"),
        '<think>ok</think>{"city": "Paris", "unit": "celsius"}', ("ok", "", [("get_weather", WEATHER)])),
    "required: a list of calls": (
        OutputFormat(None, None, forced_tool="required"),
        '[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}]',
        (None, "", [("get_weather", WEATHER)])),
}


def calls_of(parsed) -> list[tuple[str, dict]]:
    return [(call.name, json.loads(call.arguments)) for call in parsed.tool_calls]


@pytest.mark.parametrize("name", CASES)
def test_the_parse_equals_what_the_text_says(name):
    output, text, (reasoning, content, calls) = CASES[name]
    parsed = parse_message(output, text)
    assert (parsed.reasoning, parsed.content, calls_of(parsed)) == (reasoning, content, calls)


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_stream_in_any_cut_sends_exactly_the_final_parse(name, seed):
    output, text, (reasoning, content, calls) = CASES[name]
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12)))) if seed else \
        range(1, len(text))  # seed 0: one character at a time
    streamed, deltas = StreamedMessage(), []
    for cut in cuts:
        deltas += streamed.delta(output, text[:cut], is_final=False)
    deltas += streamed.delta(output, text, is_final=True)
    assert "".join(d.get("reasoning_content", "") for d in deltas) == (reasoning or "")
    assert "".join(d.get("content", "") for d in deltas) == content
    sent_calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in sent_calls] == calls
    assert [c["index"] for c in sent_calls] == list(range(len(calls)))
    assert all(c["type"] == "function" for c in sent_calls)
    for call in sent_calls:  # Mistral's templates take back only 9 letters and digits
        assert re.fullmatch("[A-Za-z0-9]{9}", call["id"]) if output.tool == "mistral" else call["id"].startswith("call_")


def test_the_message_has_openai_fields_and_null_content_beside_calls():
    output, text, _ = CASES["gpt-oss: a preamble and a call"]
    message, calls_tools = chat_message(output, text.replace("Checking.", ""))
    assert calls_tools and message["content"] is None and message["reasoning_content"] == "Need weather."
    assert message["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": json.dumps(WEATHER)}
    plain, calls_tools = chat_message(OutputFormat(), "<think>x</think>y")
    assert plain == {"role": "assistant", "content": "<think>x</think>y"} and not calls_tools


def test_harmony_headers_with_the_recipient_before_or_after_the_channel():
    messages = parse_harmony('<|channel|>analysis<|message|>a<|end|><|start|>assistant to=functions.f'
                             '<|channel|>commentary json<|message|>{}<|call|>')
    assert [(m.channel, m.recipient, m.content, m.is_complete) for m in messages] == [
        ("analysis", None, "a", True), ("commentary", "functions.f", "{}", True)]
    partial = parse_harmony("<|channel|>final<|message|>Hel<|re", is_final=False)
    assert [(m.channel, m.content, m.is_complete) for m in partial] == [("final", "Hel", False)]
