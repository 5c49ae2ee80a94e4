"""Between the job contract and the engine: a stream entry becomes an engine
request (prompt token ids + SamplingParams); a finished RequestOutput becomes an
OpenAI result line with usage."""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import ValidationError

from engine import (
    ContextLengthExceeded,
    EmbeddingRequestOutput,
    PoolingParams,
    RequestOutput,
    SamplingParams,
    StructuredOutputsParams,
)
from jobs.chat_output import OutputFormat
from jobs.responses import RESPONSES, ResponsesBody, finished_response
from jobs.results import (
    Choice,
    Usage,
    chat_choice,
    chat_completion_body,
    completion_body,
    embedding_body,
    success_line,
)
from jobs.schemas import (
    CHAT_COMPLETIONS,
    EMBEDDINGS,
    ChatBody,
    CompletionBody,
    EmbeddingBody,
    Request,
    chat_body_of,
    first_error,
)
from workers.chat_parsers import ChatParsers, reasoning_tokens, render_chat


class RequestRejected(ValueError):
    """The request can never run here; it gets an error line with this code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def error_code(error: Exception) -> str:
    """The error line's code for a request refused before it ran: a code the error names, else
    invalid_request for a value or type the request got wrong, else request_failed."""
    if isinstance(error, ContextLengthExceeded):
        return "context_length_exceeded"
    default = "invalid_request" if isinstance(error, (ValueError, TypeError)) else "request_failed"
    return getattr(error, "code", default)


def error_message(error: Exception) -> str:
    """What the error line says: a validation's own words; for anything else, what broke."""
    if isinstance(error, ValueError):
        return str(error)
    return f"the worker could not prepare this request: {type(error).__name__}: {error}"


@dataclass
class EngineRequest:
    prompt_token_ids: list[int]
    params: SamplingParams
    body: CompletionBody | ChatBody
    url: str
    output: OutputFormat = OutputFormat()  # how a chat answer's text is read
    responses: ResponsesBody | None = None  # a /v1/responses request (`body` is the chat request it stands for)


@dataclass
class EmbeddingRequest:
    inputs: list[str | list[int]]
    params: PoolingParams
    body: EmbeddingBody
    url: str = EMBEDDINGS


def to_embedding_request(request: Request) -> EmbeddingRequest:
    """An embeddings line or online body as the embedding engine's inputs and options; a
    line of another endpoint is refused (this worker serves an embedding model)."""
    if request.url != EMBEDDINGS:
        raise RequestRejected("invalid_request", f"url: this model is an embedding model; it serves {EMBEDDINGS}, "
                                                 f"not {request.url}")
    body = request.parsed_body()
    return EmbeddingRequest(body.inputs(), PoolingParams(body.dimensions, body.truncate_prompt_tokens), body)


def to_embedding_response(request: EmbeddingRequest, output: EmbeddingRequestOutput, model: str) -> tuple[dict, Usage]:
    """OpenAI's embeddings body for a finished request, and its usage (prompt tokens only)."""
    usage = Usage(prompt_tokens=output.num_prompt_tokens)
    body = embedding_body(model, [o.embedding for o in output.outputs], request.body.encoding_format,
                          usage.prompt_tokens)
    return body, usage


def to_engine_request(request: Request, tokenizer, defaults: dict | None = None,
                      parsers: ChatParsers | None = None) -> EngineRequest:
    """`tokenizer` is None on a worker started with --skip-tokenizer-init: then only
    completions with token-id prompts can run. `defaults` (the engine's
    default_sampling_params, from the model's generation_config.json) fill what the
    request leaves unset; the request always wins. `parsers`: how chat answers are read."""
    if request.url == EMBEDDINGS:
        raise RequestRejected("invalid_request", f"url: this model generates text; {EMBEDDINGS} needs a worker "
                                                 "serving an embedding model")
    body, responses = request.parsed_body(), None
    is_chat = request.url in (CHAT_COMPLETIONS, RESPONSES)
    if tokenizer is None and (is_chat or isinstance(body.prompt, str)):
        field = "messages" if request.url == CHAT_COMPLETIONS else "input" if is_chat else "prompt"
        raise RequestRejected("invalid_request", f"{field}: this worker runs without a tokenizer "
                                                 "(--skip-tokenizer-init); send completions with token-id prompts")
    output, extra = OutputFormat(), {}
    if request.url == RESPONSES:
        try:
            body, responses = chat_body_of(body), body
        except ValidationError as error:
            raise RequestRejected("invalid_request", ": ".join(first_error(error))) from None
    if is_chat:  # a template that fails on the request's messages is a ValueError naming them
        chat = render_chat(body, tokenizer, parsers or ChatParsers())
        prompt, output = chat.prompt_token_ids, chat.output
        extra = {"reasoning": chat.reasoning, "skip_special_tokens": chat.skip_special_tokens}
    else:
        prompt = tokenizer.encode(body.prompt) if isinstance(body.prompt, str) else list(body.prompt)
    try:
        constraint = body.constraint()
        params = SamplingParams(**{**(defaults or {}), **body.sampling_kwargs()}, **extra,
                                structured_outputs=StructuredOutputsParams(**constraint)
                                if constraint is not None else None)
    except (ValueError, TypeError) as error:
        raise RequestRejected("invalid_request", str(error)) from None
    return EngineRequest(list(prompt), params, body, request.url, output, responses)


def prefix_cache_salt(tenant: str, body: CompletionBody | ChatBody, is_shared: bool) -> str | None:
    """A request's prefix-cache namespace: its tenant's, so that `cached_tokens` never tells one
    tenant what another sent (unless the operator shares the cache: --shared-prefix-cache),
    and within that the request's own `cache_salt` (vLLM's)."""
    salts = ([] if is_shared else [f"tenant:{tenant}"]) + ([body.cache_salt] if body.cache_salt else [])
    return "|".join(salts) or None


def token_text(token_id: int, tokenizer) -> str:
    """A token as OpenAI's logprobs show it; without a tokenizer, vLLM's "token_id:N" form."""
    return tokenizer.decode([token_id]) if tokenizer is not None else f"token_id:{token_id}"


def openai_logprobs(output_logprobs, token_ids: list[int], num_top: int, tokenizer, url: str,
                    text_offset: int = 0):
    """Each engine entry holds the top `num_top` tokens and the sampled one; OpenAI's
    top list is the top `num_top` (with the sampled token when it ranks there).
    Completions also get each token's character offset in the completion, counted from
    `text_offset` (where a streamed delta starts)."""
    if output_logprobs is None:
        return None
    tokens = [token_text(t, tokenizer) for t in token_ids]
    chosen = [entry[t] for entry, t in zip(output_logprobs, token_ids)]
    tops = [{token_text(k, tokenizer): v for k, v in sorted(entry.items(), key=lambda kv: -kv[1])[:num_top]}
            for entry in output_logprobs]
    if url == CHAT_COMPLETIONS:
        return {"content": [{"token": tok, "logprob": lp, "top_logprobs": [
            {"token": k, "logprob": v} for k, v in top.items()]} for tok, lp, top in zip(tokens, chosen, tops)]}
    offsets = []
    for token in tokens:
        offsets.append(text_offset)
        text_offset += len(token)
    return {"tokens": tokens, "token_logprobs": chosen, "top_logprobs": tops, "text_offset": offsets}


def to_usage(request: EngineRequest, output: RequestOutput, tokenizer) -> Usage:
    return Usage(prompt_tokens=len(output.prompt_token_ids),
                 completion_tokens=sum(len(c.token_ids) for c in output.outputs),
                 cached_tokens=output.num_cached_tokens,
                 reasoning_tokens=sum(reasoning_tokens(request.output, c.token_ids, tokenizer) for c in output.outputs)
                 if request.output.reasoning else None)


def to_result_line(custom_id: str, request: EngineRequest, output: RequestOutput, model: str,
                   tokenizer) -> tuple[dict, Usage]:
    usage = to_usage(request, output, tokenizer)
    choices = [Choice(c.text, c.finish_reason or "stop",
                      openai_logprobs(c.logprobs, c.token_ids, request.params.logprobs or 0, tokenizer,
                                       request.url),
                      token_ids=c.token_ids if tokenizer is None else None) for c in output.outputs]
    if request.responses is not None:  # one choice: Responses have no n
        chat = chat_choice(0, choices[0], request.output)
        return success_line(custom_id, finished_response(request.responses, model, chat["message"],
                                                         chat["finish_reason"], usage)), usage
    if request.url == CHAT_COMPLETIONS:
        return success_line(custom_id, chat_completion_body(model, choices, usage, request.output)), usage
    return success_line(custom_id, completion_body(model, choices, usage)), usage
