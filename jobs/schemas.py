"""Request lines, validated at the boundary with pydantic v2.

Two forms are accepted, one JSON object per line:
  * the OpenAI Batch input line {"custom_id", "method": "POST", "url", "body"};
  * a short form {"custom_id"?, "prompt", <sampling fields>}; without a custom_id
    it is "line-<n>".
Unknown fields, wrong types and out-of-range values are rejected with the line
number and the field's path.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    Field,
    StrictBool,
    ValidationError,
    field_validator,
    model_validator,
)

from jobs.constraints import ConstraintFields
from jobs.constraints import StrictModel as _Strict
from jobs.messages import MAX_MESSAGES, MAX_PROMPT_CHARS, ChatMessage
from jobs.responses import RESPONSES, ResponsesBody
from jobs.tools import ToolFields

COMPLETIONS, CHAT_COMPLETIONS, EMBEDDINGS = "/v1/completions", "/v1/chat/completions", "/v1/embeddings"
ENDPOINTS = (COMPLETIONS, CHAT_COMPLETIONS, EMBEDDINGS, RESPONSES)
MAX_EMBEDDING_INPUTS = 2048  # OpenAI's limit on the inputs of one embeddings request
MAX_PROMPT_TOKENS = 1_000_000
MAX_OUTPUT_TOKENS = 1_000_000
MAX_EMBEDDING_CHARS = 4_000_000  # all of an embeddings request's text inputs together
MAX_STOP = 16
MAX_ID_CHARS = 512
MAX_REPORTED_ERRORS = 100  # invalid lines named one by one; past that, only counted
MIN_PRIORITY, MAX_PRIORITY = -(2**31), 2**31 - 1  # online priorities; batch work runs below them all
# Every integer a request carries fits the engine's 32-bit tensors (token ids, top_k) or, for a
# seed, a JSON double exactly: a bigger one would pass pydantic and break a step on the worker.
MAX_INT32 = 2**31 - 1
MAX_SEED = 2**53

ShortStr = Annotated[str, Field(max_length=256)]
TokenId = Annotated[int, Field(ge=0, le=MAX_INT32)]
StopString = Annotated[str, Field(min_length=1, max_length=256)]  # in the types, so the OpenAPI schema says it


class LineError(ValueError):
    """A request line that cannot be queued: where, which field, why."""

    def __init__(self, line_number: int, field: str, message: str) -> None:
        super().__init__(f"{line_number}: {field}: {message}")
        self.line_number, self.field, self.message = line_number, field, message


# The body fields that are engine.SamplingParams' own, under the same names.
SAMPLING_PARAMS = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "min_tokens", "stop", "presence_penalty",
                   "frequency_penalty", "repetition_penalty", "ignore_eos")


class SamplingFields(ConstraintFields):
    """Sampling fields shared by both endpoints and the short form (vLLM names)."""

    max_tokens: int | None = Field(None, ge=1, le=MAX_OUTPUT_TOKENS)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_OUTPUT_TOKENS)
    min_tokens: int | None = Field(None, ge=0, le=MAX_OUTPUT_TOKENS)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=MAX_INT32, description="-1 or 0: off; past the vocabulary: off")
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)  # exact in a JSON number (a double)
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP)] | None = None

    n: int | None = Field(None, ge=1, le=16)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, le=10)
    ignore_eos: StrictBool | None = None
    user: ShortStr | None = None  # accepted from OpenAI clients, not used
    stream: Literal[False] | None = None  # a batch cannot stream
    cache_salt: ShortStr | None = Field(None, description="vLLM's: only requests of the same salt (and tenant) "
                                                          "share cached prompt blocks")

    @field_validator("stop", mode="before")
    @classmethod
    def _check_stop(cls, stop):
        """The types say it all (and the OpenAPI schema shows them); this only names the
        rule in one message instead of one per union member."""
        strings = [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else []
        if len(strings) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings")
        if any(isinstance(s, str) and not 1 <= len(s) <= 256 for s in strings):
            raise ValueError("stop strings must be 1 to 256 characters")
        return stop

    def sampling_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for engine.SamplingParams (vLLM names), unset fields left out. Named
        one by one: a body field the engine does not take (echo, user, ...) never reaches it."""
        fields = {name: value for name in SAMPLING_PARAMS if (value := getattr(self, name)) is not None}
        max_tokens = self.max_completion_tokens or self.max_tokens
        if max_tokens is not None:
            fields["max_tokens"] = max_tokens
        if isinstance(self.stop, str):
            fields["stop"] = [self.stop]
        logprobs = self.num_logprobs()
        if logprobs is not None:
            fields["logprobs"] = logprobs
        return fields

    def num_logprobs(self) -> int | None:
        return None


class CompletionBody(SamplingFields):
    model: ShortStr | None = None
    prompt: Annotated[str, Field(min_length=1, max_length=MAX_PROMPT_CHARS)] | Annotated[
        list[TokenId], Field(min_length=1, max_length=MAX_PROMPT_TOKENS)]
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: Literal[False] | None = None

    def num_logprobs(self) -> int | None:
        return self.logprobs


class ChatBody(SamplingFields, ToolFields):
    model: ShortStr | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    logprobs: StrictBool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)

    @field_validator("messages")
    @classmethod
    def _check_total_text(cls, messages: list[ChatMessage]) -> list[ChatMessage]:
        """The messages are one prompt: together they keep a prompt's bound."""
        total = sum(len(message.text()) for message in messages)
        if total > MAX_PROMPT_CHARS:
            raise ValueError(f"the messages hold {total} characters together; at most {MAX_PROMPT_CHARS}")
        return messages

    @model_validator(mode="after")
    def _check_tools(self):
        self.check_tool_choice()
        if self.forced_tool() is not None and super().constraint() is not None:
            raise ValueError("tool_choice: a forced tool choice is a constraint of its own; "
                             "give it without response_format or structured_outputs")
        return self

    def constraint(self) -> dict[str, Any] | None:
        """A forced tool choice's grammar, or the body's response_format / structured_outputs."""
        if self.forced_tool() is not None:
            return {"json": self.forced_schema()}
        return super().constraint()

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.template_form() for m in self.messages]


NonEmptyText = Annotated[str, Field(min_length=1, max_length=MAX_PROMPT_CHARS)]
TokenIds = Annotated[list[TokenId], Field(min_length=1, max_length=MAX_PROMPT_TOKENS)]


class EmbeddingBody(_Strict):
    """POST /v1/embeddings, OpenAI's fields and vLLM's truncate_prompt_tokens."""

    model: ShortStr | None = None
    input: NonEmptyText | Annotated[list[NonEmptyText], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)] \
        | TokenIds | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)]
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: int | None = Field(None, ge=1, le=65536, description="Matryoshka models only")
    user: ShortStr | None = None  # accepted from OpenAI clients, not used
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=MAX_PROMPT_TOKENS,
                                               description="keep the first tokens of a longer input; -1: the model's "
                                                           "limit (vLLM)")

    @field_validator("input", mode="wrap")
    @classmethod
    def _check_input(cls, value, handler):
        """pydantic's own rules for the four shapes, with one message naming them instead of
        one per union member."""
        if isinstance(value, list) and len(value) > MAX_EMBEDDING_INPUTS and not all(
                isinstance(x, int) for x in value):
            raise ValueError(f"at most {MAX_EMBEDDING_INPUTS} inputs per request")
        try:
            value = handler(value)
        except ValidationError:
            raise ValueError("must be a non-empty string, a list of non-empty strings, a list of token ids "
                             "(integers >= 0), or a list of such lists") from None
        items = [value] if isinstance(value, str) or value and isinstance(value[0], int) else value
        num_chars = sum(len(item) for item in items if isinstance(item, str))
        num_tokens = sum(len(item) for item in items if isinstance(item, list))
        if num_chars > MAX_EMBEDDING_CHARS or num_tokens > MAX_PROMPT_TOKENS:
            raise ValueError(f"the inputs hold {num_chars} characters and {num_tokens} token ids together; at most "
                             f"{MAX_EMBEDDING_CHARS} characters and {MAX_PROMPT_TOKENS} token ids")
        return value

    def inputs(self) -> list[str | list[int]]:
        """One entry per input: a string or a list of token ids."""
        if isinstance(self.input, str) or self.input and isinstance(self.input[0], int):
            return [self.input]
        return list(self.input)


class BatchLine(_Strict):
    custom_id: Annotated[str, Field(min_length=1, max_length=MAX_ID_CHARS)]
    method: Literal["POST"]
    url: Literal[COMPLETIONS, CHAT_COMPLETIONS, EMBEDDINGS, RESPONSES]  # ENDPOINTS
    body: dict[str, Any]


class ShortLine(SamplingFields):
    custom_id: Annotated[str, Field(min_length=1, max_length=MAX_ID_CHARS)] | None = None
    model: ShortStr | None = None
    prompt: Annotated[str, Field(min_length=1, max_length=MAX_PROMPT_CHARS)]
    logprobs: int | None = Field(None, ge=0, le=5)


class StreamOptions(_Strict):
    include_usage: StrictBool | None = None


class OnlineFields(_Strict):
    """What an online request adds to a batch line's body; `model` is required, as in OpenAI's API."""

    model: ShortStr
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None
    priority: int = Field(0, ge=MIN_PRIORITY, le=MAX_PRIORITY, description="lower runs first, as in vLLM")

    def batch_body(self) -> dict[str, Any]:
        """The body as a batch line would carry it: what the worker validates and runs."""
        return self.model_dump(exclude_none=True, exclude={"stream", "stream_options", "priority"})

    @property
    def include_usage(self) -> bool:
        """stream_options apply to streams only; without stream they are ignored."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class OnlineEmbeddingBody(EmbeddingBody):
    """POST /v1/embeddings: `model` is required; never streamed."""

    model: ShortStr
    priority: int = Field(0, ge=MIN_PRIORITY, le=MAX_PRIORITY, description="lower runs first, as in vLLM")
    stream: ClassVar[None] = None

    def batch_body(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True, exclude={"priority"})


class OnlineCompletionBody(OnlineFields, CompletionBody):
    """POST /v1/completions."""


class OnlineChatBody(OnlineFields, ChatBody):
    """POST /v1/chat/completions."""


class OnlineResponsesBody(OnlineFields, ResponsesBody):
    """POST /v1/responses."""

    def batch_body(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True, by_alias=True, exclude={"stream", "stream_options", "priority"})


class Request(BaseModel):
    """A validated request, as it travels through the stream."""

    custom_id: str
    url: str
    body: dict[str, Any]

    def parsed_body(self) -> CompletionBody | ChatBody | EmbeddingBody | ResponsesBody:
        return body_model(self.url).model_validate(self.body)


def body_model(url: str) -> type[CompletionBody | ChatBody | EmbeddingBody | ResponsesBody]:
    return {CHAT_COMPLETIONS: ChatBody, EMBEDDINGS: EmbeddingBody, RESPONSES: ResponsesBody}.get(url, CompletionBody)


def chat_body_of(body: ResponsesBody) -> ChatBody:
    """The chat request a Responses body stands for (ValidationError: what does not fit one,
    such as a tool_choice naming no tool)."""
    return ChatBody.model_validate(body.chat_fields())


def field_path(loc: tuple) -> list[str]:
    """A pydantic error location as the request's own field names."""
    # Union members add their type name to the path; keep only the fields.
    path = [str(p) for p in loc
            if not (isinstance(p, str) and ("[" in p or "-" in p or p in {"str", "list", "int", "float", "bool"}))]
    # A tagged union repeats its tag before the member's field of the same name (regex.regex).
    return [part for index, part in enumerate(path) if index == 0 or part != path[index - 1]]


def first_error(error: ValidationError, prefix: str = "") -> tuple[str, str]:
    detail = error.errors()[0]
    path = field_path(detail["loc"])
    return prefix + ".".join(path) if path else prefix.rstrip(".") or "line", detail["msg"].removeprefix("Value error, ")


def parse_line(text: str | bytes, line_number: int) -> Request:
    """Validate one JSONL line into a Request, or raise LineError naming the field."""
    try:
        record = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise LineError(line_number, "line", f"not valid JSON ({error})") from None
    except RecursionError:
        raise LineError(line_number, "line", "nests too deeply to parse") from None
    if not isinstance(record, dict):
        raise LineError(line_number, "line", "must be a JSON object")
    try:
        if "body" in record or "url" in record or "method" in record:
            line = BatchLine.model_validate(record)
            try:
                body = body_model(line.url).model_validate(line.body)
                if line.url == RESPONSES:
                    chat_body_of(body)
            except ValidationError as error:
                raise LineError(line_number, *first_error(error, "body.")) from None
            return Request(custom_id=line.custom_id, url=line.url,
                           body=body.model_dump(exclude_none=True, by_alias=True))
        short = ShortLine.model_validate(record)
    except ValidationError as error:
        raise LineError(line_number, *first_error(error)) from None
    body = short.model_dump(exclude_none=True, exclude={"custom_id"})
    return Request(custom_id=short.custom_id or f"line-{line_number}", url=COMPLETIONS, body=body)


def custom_id_of(raw: str | bytes, line_number: int) -> str:
    """The line's custom id if it has a usable one, even when the line is invalid
    otherwise; else "line-<n>", as for short-form lines without one."""
    try:
        custom_id = json.loads(raw).get("custom_id")
    except (ValueError, AttributeError, RecursionError):
        custom_id = None
    return custom_id if isinstance(custom_id, str) and custom_id else f"line-{line_number}"
