"""Chat prompts as the checkpoints' own templates render them (workers/chat_parsers.py): gpt-oss in
the harmony format token for token, Qwen3's tools and tool results, template options; and the
real SmolLM2, which does not think, answers as before."""

from __future__ import annotations

import time

import pytest

from engine import LLMEngine
from engine.config import EngineConfig
from jobs.schemas import Request
from tests.chat_models import thinking_tokenizer
from workers.chat_parsers import ChatParsers
from workers.translate import RequestRejected, to_engine_request, to_result_line

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Gets the weather in a city",
    "parameters": {"type": "object", "properties": {"location": {"type": "string", "description": "The city"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["location"]}}}
CONVERSATION = [
    {"role": "system", "content": "Answer in French."},
    {"role": "user", "content": "What is the weather in Tokyo?"},
    {"role": "assistant", "content": None, "reasoning_content": "Need to call get_weather.",
     "tool_calls": [{"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"location": "Tokyo"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "20 degrees"},
]


def render(tokenizer, parsers: ChatParsers, **body):
    request = Request(custom_id="c", url="/v1/chat/completions", body={"messages": CONVERSATION, **body})
    return to_engine_request(request, tokenizer, {}, parsers)


def harmony_prompt(date: str) -> str:
    """gpt-oss's prompt for CONVERSATION, written by hand from OpenAI's harmony format: the system
    message (identity, dates, reasoning effort, channels), the developer message (instructions and
    the functions namespace in TypeScript), the turns, the earlier call with its analysis and its
    result from the tool, and the generation prompt."""
    return (
        "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
        f"Knowledge cutoff: 2024-06\nCurrent date: {date}\n\nReasoning: high\n\n"
        "# Valid channels: analysis, commentary, final. Channel must be included for every message.\n"
        "Calls to these tools must go to the commentary channel: 'functions'.<|end|>"
        "<|start|>developer<|message|># Instructions\n\nAnswer in French.\n\n# Tools\n\n## functions\n\n"
        "namespace functions {\n\n// Gets the weather in a city\ntype get_weather = (_: {\n// The city\n"
        'location: string,\nunit?: "celsius" | "fahrenheit",\n}) => any;\n\n} // namespace functions<|end|>'
        "<|start|>user<|message|>What is the weather in Tokyo?<|end|>"
        "<|start|>assistant<|channel|>analysis<|message|>Need to call get_weather.<|end|>"
        '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"location": "Tokyo"}'
        "<|call|>"
        '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"20 degrees"<|end|>'
        "<|start|>assistant")


def test_gpt_oss_prompts_are_the_harmony_format_token_for_token():
    tokenizer = thinking_tokenizer("gpt_oss")
    dates = {time.strftime("%Y-%m-%d")}
    request = render(tokenizer, ChatParsers("gpt_oss", "openai"), tools=[WEATHER], reasoning_effort="xhigh")
    dates.add(time.strftime("%Y-%m-%d"))  # the template writes today's date: either side of midnight
    expected = [tokenizer.encode(harmony_prompt(date), add_special_tokens=False) for date in sorted(dates)]
    assert request.prompt_token_ids in expected
    for marker in ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>"):  # each marker one token
        assert request.prompt_token_ids.count(tokenizer.convert_tokens_to_ids(marker)) == \
            harmony_prompt("").count(marker)
    # The output keeps its special tokens (the channels are read from them) and begins in the analysis.
    assert not request.params.skip_special_tokens and request.output.phase == "reasoning"


def test_qwen3_renders_tools_calls_and_results_with_its_template():
    tokenizer = thinking_tokenizer("qwen3")
    request = render(tokenizer, ChatParsers("qwen3", "hermes"), tools=[WEATHER])
    prompt = tokenizer.decode(request.prompt_token_ids)
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather", ' in prompt
    # The call's arguments reach the template as an object: written once as JSON, not as a quoted string.
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"location": "Tokyo"}}\n</tool_call>' in prompt
    assert "<|im_start|>user\n<tool_response>\n20 degrees\n</tool_response><|im_end|>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n") and request.output.phase == "undecided"
    assert request.params.skip_special_tokens and request.output.tool == "hermes"
    for closing in ({"chat_template_kwargs": {"enable_thinking": False}}, {"reasoning_effort": "none"}):
        closed = render(tokenizer, ChatParsers("qwen3", "hermes"), **closing)
        assert tokenizer.decode(closed.prompt_token_ids).endswith("<think>\n\n</think>\n\n")
        assert closed.output.phase == "answer" and closed.output.tool is None  # no tools offered: none parsed


@pytest.mark.parametrize("body, message", [
    ({"chat_template_kwargs": {"tokenize": False}}, "chat_template_kwargs: tokenize cannot be set here"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "no tool named 'nope'"),
    ({"tool_choice": "required"}, "tool_choice: required needs tools"),
])
def test_template_options_and_tool_choices_that_cannot_work_are_refused(body, message):
    with pytest.raises((RequestRejected, ValueError), match=message):
        render(thinking_tokenizer("qwen3"), ChatParsers("qwen3", "hermes"), **body)


def test_unknown_parsers_are_refused_at_start_and_defaults_follow_the_model_type():
    assert ChatParsers.resolve("qwen3") == ChatParsers("qwen3", "hermes")
    assert ChatParsers.resolve("gpt_oss") == ChatParsers("gpt_oss", "openai")
    assert ChatParsers.resolve("llama") == ChatParsers(None, "llama3_json")
    assert ChatParsers.resolve("qwen3", "none", "none") == ChatParsers()
    assert ChatParsers.resolve("qwen2", "deepseek_r1") == ChatParsers("deepseek_r1", "hermes")
    with pytest.raises(SystemExit, match="--reasoning-parser: unknown parser 'r2'"):
        ChatParsers.resolve("qwen3", "r2")


def test_the_real_smollm2_answers_as_before_with_no_reasoning_and_no_invented_call():
    engine = LLMEngine(EngineConfig(model="demo", dtype="float32", num_kv_blocks=128))
    parsers = ChatParsers.resolve(engine.hf_config.model_type)
    question = [{"role": "user", "content": "What is the capital of France?"}]
    lines = {}
    for name, extra in {"plain": {}, "tools": {"tools": [WEATHER]}}.items():
        body = {"messages": question, "max_tokens": 24, "temperature": 0, **extra}
        request = to_engine_request(Request(custom_id=name, url="/v1/chat/completions", body=body),
                                    engine.tokenizer, {}, parsers)
        engine.add_request(name, request.prompt_token_ids, request.params)
        while engine.has_unfinished():
            for output in engine.step():
                lines[output.request_id] = to_result_line(name, request, output, "demo", engine.tokenizer)[0]
    plain = lines["plain"]["response"]["body"]["choices"][0]
    assert plain["message"] == {"role": "assistant", "content": plain["message"]["content"]}
    assert "Paris" in plain["message"]["content"] and plain["finish_reason"] in ("stop", "length")
    assert "completion_tokens_details" not in lines["plain"]["response"]["body"]["usage"]
    offered = lines["tools"]["response"]["body"]["choices"][0]
    assert "tool_calls" not in offered["message"] and "reasoning_content" not in offered["message"]
    assert offered["finish_reason"] in ("stop", "length")
