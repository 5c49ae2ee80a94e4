"""A chat request's prompt and how its answer is read: the chat template rendered with the
request's tools and template variables, the worker's reasoning and tool parsers (vLLM's
names; by default the model type's), and what the engine needs of them (the reasoning's
marker tokens, the special tokens kept in the text)."""

from __future__ import annotations

import argparse
import functools
import inspect
import logging
from dataclasses import dataclass

from engine import ReasoningMarkers
from jobs.chat_output import OutputFormat
from jobs.harmony import CHANNEL, CONTENT_ENDS, MESSAGE
from jobs.reasoning import REASONING_PARSERS, default_reasoning_parser, initial_phase, markers
from jobs.schemas import ChatBody
from jobs.tool_calls import SPECIAL_TOKEN_PARSERS, TOOL_PARSERS, default_tool_parser

log = logging.getLogger("kvfleet.worker")


@dataclass(frozen=True)
class ChatParsers:
    reasoning: str | None = None
    tool: str | None = None

    @classmethod
    def resolve(cls, model_type: str, reasoning_parser: str | None = None,
                tool_call_parser: str | None = None) -> ChatParsers:
        """--reasoning-parser / --tool-call-parser: a name, "none", or unset for the model type's."""
        def pick(given: str | None, names: tuple[str, ...], default: str | None, flag: str) -> str | None:
            if given is None or given == "auto":
                return default
            if given == "none":
                return None
            if given not in names:
                raise SystemExit(f"{flag}: unknown parser {given!r}; one of {', '.join(names)} or none")
            return given
        return cls(pick(reasoning_parser, REASONING_PARSERS, default_reasoning_parser(model_type),
                        "--reasoning-parser"),
                   pick(tool_call_parser, TOOL_PARSERS, default_tool_parser(model_type), "--tool-call-parser"))

    @classmethod
    def of_engine(cls, engine, reasoning_parser: str | None = None, tool_call_parser: str | None = None) -> ChatParsers:
        """The parsers of an engine's model, said once at start-up (none for an embedding model)."""
        hf_config = getattr(engine, "hf_config", None)  # none: an engine without a model (benchmarks' stand-in)
        if getattr(engine, "task", "generate") != "generate" or hf_config is None:
            return cls()
        model_type = hf_config.model_type
        parsers = cls.resolve(model_type, reasoning_parser, tool_call_parser)
        log.info("chat parsers (model type %s): reasoning %s, tool calls %s", model_type, parsers.reasoning or "none",
                 parsers.tool or "none")
        return parsers


def add_parser_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    parser.add_argument("--reasoning-parser", choices=(*REASONING_PARSERS, "none"),
                        help="how chat answers' reasoning is read into reasoning_content (vLLM's names); default: "
                             "the model type's (qwen3 for Qwen3, gpt_oss for gpt-oss), else none")
    parser.add_argument("--tool-call-parser", choices=(*TOOL_PARSERS, "none"),
                        help="how tool calls are read from chat answers when a request offers tools (vLLM's names); "
                             "default: the model type's (hermes for Qwen, llama3_json for Llama, mistral, openai "
                             "for gpt-oss), else none")


# OpenAI's reasoning_effort values as the templates know them (gpt-oss's low, medium, high).
TEMPLATE_EFFORT = {"none": "low", "minimal": "low", "low": "low", "medium": "medium", "high": "high", "xhigh": "high",
                   "max": "high"}


@dataclass
class RenderedChat:
    prompt_token_ids: list[int]
    output: OutputFormat
    reasoning: ReasoningMarkers | None  # for a constrained request: the grammar waits for the answer
    skip_special_tokens: bool


@functools.cache
def template_parameters(tokenizer_class: type) -> frozenset[str]:
    """The arguments apply_chat_template takes itself (once per tokenizer class)."""
    return frozenset(inspect.signature(tokenizer_class.apply_chat_template).parameters)


def template_kwargs(body: ChatBody, tokenizer) -> dict:
    """The request's template variables; a name apply_chat_template takes itself is refused
    (it would change how the prompt is made, not what the template sees)."""
    kwargs = dict(body.chat_template_kwargs or {})
    taken = sorted(set(kwargs) & template_parameters(type(tokenizer)))
    if taken:
        raise ValueError(f"chat_template_kwargs: {', '.join(taken)} cannot be set here")
    if body.reasoning_effort is not None:
        kwargs.setdefault("reasoning_effort", TEMPLATE_EFFORT[body.reasoning_effort])
        if body.reasoning_effort == "none":  # no reasoning: a Qwen3's template closes <think> at once
            kwargs.setdefault("enable_thinking", False)
    return kwargs


def token_ids_of(tokenizer, text: str) -> tuple[int, ...]:
    return tuple(tokenizer.encode(text, add_special_tokens=False))


def render_chat(body: ChatBody, tokenizer, parsers: ChatParsers) -> RenderedChat:
    """The prompt of a chat request and how its output is read (ValueError: the request's fault)."""
    kwargs = template_kwargs(body, tokenizer)
    try:
        prompt = tokenizer.apply_chat_template(body.template_messages(), tools=body.template_tools(),
                                               add_generation_prompt=True, tokenize=False, **kwargs)
    except Exception as error:  # noqa: BLE001 (a template error is the request's fault)
        raise ValueError(f"messages: the chat template failed: {error}") from None
    forced = body.forced_tool()
    tool = parsers.tool if body.offered_tools() and forced is None else None
    phase = initial_phase(parsers.reasoning, prompt) if parsers.reasoning else "answer"
    output = OutputFormat(parsers.reasoning, tool, forced, phase)
    gate = None
    if parsers.reasoning and body.constraint() is not None and phase != "answer":
        start, end = markers(parsers.reasoning)
        start_ids = token_ids_of(tokenizer, start) if start else ()
        # A tokenizer without <think> as one token cannot offer it beside the grammar's first token:
        # such a model is no thinking model, and its answer is constrained from the start.
        gate = ReasoningMarkers(token_ids_of(tokenizer, end), start_ids[0] if len(start_ids) == 1 else None,
                                phase if phase != "undecided" or len(start_ids) == 1 else "answer")
    keep_special = parsers.reasoning == "gpt_oss" or tool in SPECIAL_TOKEN_PARSERS
    return RenderedChat(list(token_ids_of(tokenizer, prompt)), output, gate, not keep_special)


def reasoning_tokens(output: OutputFormat, token_ids: list[int], tokenizer) -> int:
    """How many of a choice's tokens are reasoning (usage's completion_tokens_details)."""
    if output.reasoning is None or tokenizer is None or output.phase == "answer":
        return 0
    if output.reasoning == "gpt_oss":
        return harmony_reasoning_tokens(token_ids, tokenizer)
    start, end = (token_ids_of(tokenizer, marker) for marker in markers(output.reasoning))
    for index in range(len(token_ids) - len(end) + 1):
        if tuple(token_ids[index:index + len(end)]) == end:
            return index + len(end)
    is_reasoning = output.phase == "reasoning" or len(start) == 1 and token_ids[:1] == [start[0]]
    return len(token_ids) if is_reasoning else 0


def harmony_reasoning_tokens(token_ids: list[int], tokenizer) -> int:
    """The tokens of gpt-oss's analysis messages, headers and end markers included."""
    ends = {tokenizer.convert_tokens_to_ids(marker) for marker in CONTENT_ENDS}
    message_id = tokenizer.convert_tokens_to_ids(MESSAGE)
    count, message = 0, []
    for token_id in token_ids:
        message.append(token_id)
        if token_id in ends:
            header = message[:message.index(message_id)] if message_id in message else message
            if f"{CHANNEL}analysis" in tokenizer.decode(header, skip_special_tokens=False):
                count += len(message)
            message = []
    return count
