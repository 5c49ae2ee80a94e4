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
import re
from typing import Annotated, Any, Literal

import jsonschema
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    StrictBool,
    Tag,
    ValidationError,
    field_validator,
    model_validator,
)

COMPLETIONS, CHAT_COMPLETIONS = "/v1/completions", "/v1/chat/completions"
ENDPOINTS = (COMPLETIONS, CHAT_COMPLETIONS)
MAX_PROMPT_CHARS = 1_000_000
MAX_PROMPT_TOKENS = 1_000_000
MAX_OUTPUT_TOKENS = 1_000_000
MAX_MESSAGES = 1024
MAX_STOP = 16
MAX_ID_CHARS = 512
MAX_REPORTED_ERRORS = 100  # invalid lines named one by one; past that, only counted
MAX_CONSTRAINT_CHARS = 100_000
MIN_PRIORITY, MAX_PRIORITY = -(2**31), 2**31 - 1  # online priorities; batch work runs below them all

ShortStr = Annotated[str, Field(max_length=256)]
StopString = Annotated[str, Field(min_length=1, max_length=256)]  # in the types, so the OpenAPI schema says it


class LineError(ValueError):
    """A request line that cannot be queued: where, which field, why."""

    def __init__(self, line_number: int, field: str, message: str) -> None:
        super().__init__(f"{line_number}: {field}: {message}")
        self.line_number, self.field, self.message = line_number, field, message


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


def check_json_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """A JSON Schema that is itself valid (its metaschema); the worker's compiler checks the rest."""
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as error:
        where = "/".join(str(p) for p in error.absolute_path)
        raise ValueError(f"not a valid JSON Schema{f' at {where}' if where else ''}: {error.message}") from None
    return schema


def check_regex(pattern: str) -> str:
    try:
        re.compile(pattern)
    except re.error as error:
        raise ValueError(f"not a valid regex: {error}") from None
    return pattern


JsonSchema = Annotated[dict[str, Any], AfterValidator(check_json_schema)]
Regex = Annotated[str, Field(min_length=1, max_length=MAX_CONSTRAINT_CHARS, json_schema_extra={"format": "regex"}),
                  AfterValidator(check_regex)]


class JsonSchemaFormat(_Strict):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: Annotated[str, Field(max_length=MAX_CONSTRAINT_CHARS)] | None = None
    schema_: JsonSchema = Field(alias="schema")
    strict: StrictBool | None = None


class TextFormat(_Strict):
    type: Literal["text"]


class JsonObjectFormat(_Strict):
    type: Literal["json_object"]


class JsonSchemaResponseFormat(_Strict):
    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


# OpenAI's response_format, one model per type, so the OpenAPI schema says which fields go with which.
ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaResponseFormat, Field(discriminator="type")]


class _OneConstraint(_Strict):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    def as_params(self) -> dict[str, Any]:
        """engine.StructuredOutputsParams' fields."""
        return self.model_dump(by_alias=True)


class JsonConstraint(_OneConstraint):
    json_: JsonSchema = Field(alias="json")


class RegexConstraint(_OneConstraint):
    regex: Regex


class ChoiceConstraint(_OneConstraint):
    choice: Annotated[list[Annotated[str, Field(min_length=1, max_length=256)]], Field(min_length=1, max_length=256)]


class GrammarConstraint(_OneConstraint):
    grammar: Annotated[str, Field(min_length=1, max_length=MAX_CONSTRAINT_CHARS)]


class JsonObjectConstraint(_OneConstraint):
    json_object: Literal[True]


# vLLM's structured_outputs: exactly one of json, regex, choice, grammar, json_object.
CONSTRAINT_KEYS = ("json", "regex", "choice", "grammar", "json_object")
def _constraint_key(value) -> str | None:
    if isinstance(value, dict):
        return next(iter(value), None)
    return next((key for key in CONSTRAINT_KEYS if key in value.as_params()), None)


StructuredOutputsFields = Annotated[
    Annotated[JsonConstraint, Tag("json")] | Annotated[RegexConstraint, Tag("regex")]
    | Annotated[ChoiceConstraint, Tag("choice")] | Annotated[GrammarConstraint, Tag("grammar")]
    | Annotated[JsonObjectConstraint, Tag("json_object")],
    Discriminator(_constraint_key)]


class SamplingFields(_Strict):
    """Sampling fields shared by both endpoints and the short form (vLLM names)."""

    max_tokens: int | None = Field(None, ge=1, le=MAX_OUTPUT_TOKENS)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_OUTPUT_TOKENS)
    min_tokens: int | None = Field(None, ge=0, le=MAX_OUTPUT_TOKENS)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = Field(None, ge=0, le=2**53)  # exact in a JSON number (a double)
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP)] | None = None

    n: int | None = Field(None, ge=1, le=16)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, le=10)
    ignore_eos: StrictBool | None = None
    user: ShortStr | None = None  # accepted from OpenAI clients, not used
    stream: Literal[False] | None = None  # a batch cannot stream
    response_format: ResponseFormat | None = None  # OpenAI's
    structured_outputs: StructuredOutputsFields | None = None  # vLLM's extension

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

    @field_validator("structured_outputs", mode="before")
    @classmethod
    def _check_structured_outputs(cls, value):
        """One message for the rule the union states (each member's errors would be noise)."""
        if isinstance(value, dict) and len(value) != 1:
            raise ValueError(f"give exactly one of {', '.join(CONSTRAINT_KEYS)}, got {sorted(value) or 'none'}")
        if isinstance(value, dict) and next(iter(value)) not in CONSTRAINT_KEYS:
            raise ValueError(f"unknown constraint {next(iter(value))!r}; one of {', '.join(CONSTRAINT_KEYS)}")
        return value

    @field_validator("response_format", mode="before")
    @classmethod
    def _check_response_format(cls, value):
        if isinstance(value, dict) and value.get("type") == "json_schema" and "json_schema" not in value:
            raise ValueError("json_schema: required with type json_schema")
        return value

    @model_validator(mode="after")
    def _one_constraint(self):
        if self.structured_outputs is not None and self.response_format is not None \
                and self.response_format.type != "text":
            raise ValueError("response_format, structured_outputs: give one constraint, not both")
        return self

    def constraint(self) -> dict[str, Any] | None:
        """The output constraint as engine.StructuredOutputsParams' fields, or None."""
        if self.structured_outputs is not None:
            return self.structured_outputs.as_params()
        if self.response_format is None or self.response_format.type == "text":
            return None
        if self.response_format.type == "json_object":
            return {"json_object": True}
        return {"json": self.response_format.json_schema.schema_}

    def sampling_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for engine.SamplingParams (vLLM names), unset fields left out."""
        fields = self.model_dump(exclude_none=True, exclude={"model", "prompt", "messages", "user", "stream",
                                                              "response_format", "structured_outputs",
                                                              "max_completion_tokens", "logprobs",
                                                              "top_logprobs", "custom_id"})
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
        list[Annotated[int, Field(ge=0)]], Field(min_length=1, max_length=MAX_PROMPT_TOKENS)]
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: Literal[False] | None = None

    def num_logprobs(self) -> int | None:
        return self.logprobs


class TextPart(_Strict):
    type: Literal["text"]
    text: Annotated[str, Field(max_length=MAX_PROMPT_CHARS)]


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: Annotated[str, Field(max_length=MAX_PROMPT_CHARS)] | Annotated[list[TextPart], Field(max_length=64)]
    name: ShortStr | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class ChatBody(SamplingFields):
    model: ShortStr | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    logprobs: StrictBool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_messages(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]


class BatchLine(_Strict):
    custom_id: Annotated[str, Field(min_length=1, max_length=MAX_ID_CHARS)]
    method: Literal["POST"]
    url: Literal["/v1/completions", "/v1/chat/completions"]
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


class OnlineCompletionBody(OnlineFields, CompletionBody):
    """POST /v1/completions."""


class OnlineChatBody(OnlineFields, ChatBody):
    """POST /v1/chat/completions."""


class Request(BaseModel):
    """A validated request, as it travels through the stream."""

    custom_id: str
    url: str
    body: dict[str, Any]

    def parsed_body(self) -> CompletionBody | ChatBody:
        return (ChatBody if self.url == CHAT_COMPLETIONS else CompletionBody).model_validate(self.body)


def field_path(loc: tuple) -> list[str]:
    """A pydantic error location as the request's own field names."""
    # Union members add their type name to the path; keep only the fields.
    path = [str(p) for p in loc
            if not (isinstance(p, str) and ("[" in p or "-" in p or p in {"str", "list", "int", "float", "bool"}))]
    # A tagged union repeats its tag before the member's field of the same name (regex.regex).
    return [part for index, part in enumerate(path) if index == 0 or part != path[index - 1]]


def _first_error(error: ValidationError, prefix: str = "") -> tuple[str, str]:
    detail = error.errors()[0]
    path = field_path(detail["loc"])
    return prefix + ".".join(path) if path else prefix.rstrip(".") or "line", detail["msg"].removeprefix("Value error, ")


def parse_line(text: str | bytes, line_number: int) -> Request:
    """Validate one JSONL line into a Request, or raise LineError naming the field."""
    try:
        record = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise LineError(line_number, "line", f"not valid JSON ({error})") from None
    if not isinstance(record, dict):
        raise LineError(line_number, "line", "must be a JSON object")
    try:
        if "body" in record or "url" in record or "method" in record:
            line = BatchLine.model_validate(record)
            body_model = ChatBody if line.url == CHAT_COMPLETIONS else CompletionBody
            try:
                body = body_model.model_validate(line.body)
            except ValidationError as error:
                raise LineError(line_number, *_first_error(error, "body.")) from None
            return Request(custom_id=line.custom_id, url=line.url, body=body.model_dump(exclude_none=True))
        short = ShortLine.model_validate(record)
    except ValidationError as error:
        raise LineError(line_number, *_first_error(error)) from None
    body = short.model_dump(exclude_none=True, exclude={"custom_id"})
    return Request(custom_id=short.custom_id or f"line-{line_number}", url=COMPLETIONS, body=body)


def custom_id_of(raw: str | bytes, line_number: int) -> str:
    """The line's custom id if it has a usable one, even when the line is invalid
    otherwise; else "line-<n>", as for short-form lines without one."""
    try:
        custom_id = json.loads(raw).get("custom_id")
    except (ValueError, AttributeError):
        custom_id = None
    return custom_id if isinstance(custom_id, str) and custom_id else f"line-{line_number}"
