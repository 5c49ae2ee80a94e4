"""OpenAI's Responses API (`/v1/responses`), online and in batch lines: its request body, read
as the chat request it stands for, and its answer, a Response object.

Responses are not stored: `store` is accepted and the answer says false, and
`previous_response_id` is refused (send the conversation in `input`). Function tools only.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, StrictBool, Tag, field_validator

from jobs.constraints import JsonSchema
from jobs.constraints import StrictModel as _Strict
from jobs.results import Usage
from jobs.tools import MAX_ARGUMENTS_CHARS, MAX_TOOLS, FunctionName, ReasoningEffort, ToolSchema

RESPONSES = "/v1/responses"
MAX_INPUT_ITEMS = 1024
MAX_TEXT_CHARS = 1_000_000
Text = Annotated[str, Field(max_length=MAX_TEXT_CHARS)]
ItemId = Annotated[str, Field(min_length=1, max_length=256)]


class ContentPart(_Strict):
    type: Literal["input_text", "output_text"]
    text: Text
    annotations: list[Any] | None = None  # an output_text's, when a client sends an answer back


class MessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Text | Annotated[list[ContentPart], Field(max_length=64)]
    id: ItemId | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: ItemId
    name: FunctionName
    arguments: Annotated[str, Field(max_length=MAX_ARGUMENTS_CHARS)]
    id: ItemId | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: ItemId
    output: Text
    id: ItemId | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class ReasoningText(_Strict):
    type: Literal["reasoning_text"]
    text: Text


class ReasoningItem(_Strict):
    """An earlier answer's reasoning, sent back: it reaches the template as reasoning_content."""

    type: Literal["reasoning"]
    id: ItemId | None = None
    summary: list[Any] = []
    content: Annotated[list[ReasoningText], Field(max_length=64)] | None = None
    encrypted_content: None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


def _item_type(value) -> str | None:
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", "message")
    # Tags with "-" stay out of error paths (schemas.field_path): body.input.0.content, not ....message.content
    return f"item-{kind}" if kind in ("message", "function_call", "function_call_output", "reasoning") else None


InputItem = Annotated[Annotated[MessageItem, Tag("item-message")] | Annotated[FunctionCallItem, Tag("item-function_call")]
                      | Annotated[FunctionCallOutputItem, Tag("item-function_call_output")]
                      | Annotated[ReasoningItem, Tag("item-reasoning")],
                      Discriminator(_item_type, custom_error_type="invalid_item",
                                    custom_error_message="type: must be message, function_call, "
                                                         "function_call_output or reasoning")]


class FunctionTool(_Strict):
    type: Literal["function"]
    name: FunctionName
    description: Annotated[str, Field(max_length=100_000)] | None = None
    parameters: ToolSchema | None = None
    strict: StrictBool | None = None


class NamedFunction(_Strict):
    type: Literal["function"]
    name: FunctionName


class TextFormatText(_Strict):
    type: Literal["text"]

    def response_format(self) -> dict[str, Any]:
        return {"type": self.type}


class TextFormatJsonObject(TextFormatText):
    type: Literal["json_object"]


class TextFormatJsonSchema(_Strict):
    type: Literal["json_schema"]
    name: Annotated[str, Field(min_length=1, max_length=64)]
    schema_: JsonSchema = Field(alias="schema")
    description: Annotated[str, Field(max_length=100_000)] | None = None
    strict: StrictBool | None = None

    def response_format(self) -> dict[str, Any]:
        """As a chat body's response_format."""
        schema = {"name": self.name, "schema": self.schema_,
                  **{key: value for key in ("description", "strict") if (value := getattr(self, key)) is not None}}
        return {"type": "json_schema", "json_schema": schema}


TextFormat = Annotated[TextFormatText | TextFormatJsonObject | TextFormatJsonSchema, Field(discriminator="type")]


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # accepted, not used


class ReasoningConfig(_Strict):
    effort: ReasoningEffort | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None  # accepted; the whole reasoning is returned


class ResponsesBody(_Strict):
    """POST /v1/responses, OpenAI's fields that a self-hosted model can honour."""

    model: Annotated[str, Field(max_length=256)] | None = None
    input: Annotated[Annotated[Annotated[str, Field(min_length=1, max_length=MAX_TEXT_CHARS)], Tag("input-text")]
                     | Annotated[Annotated[list[InputItem], Field(min_length=1, max_length=MAX_INPUT_ITEMS)],
                                 Tag("input-items")],
                     Discriminator(lambda value: "input-items" if isinstance(value, list) else "input-text")]
    instructions: Text | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=1_000_000)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    tools: Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: StrictBool | None = None
    previous_response_id: None = Field(None, description="not supported: responses are not stored")
    store: StrictBool | None = None
    metadata: Annotated[dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
                        Field(max_length=16)] | None = None
    user: Annotated[str, Field(max_length=256)] | None = None
    truncation: Literal["disabled"] | None = None
    stream: Literal[False] | None = None  # a batch cannot stream

    @field_validator("previous_response_id", mode="before")
    @classmethod
    def _not_stored(cls, value):
        if value is not None:
            raise ValueError("not supported: kvfleet does not store responses; send the whole conversation in "
                             "input (earlier outputs as items)")
        return value

    def chat_fields(self) -> dict[str, Any]:
        """The chat completions body this request stands for (validated as one by the caller)."""
        fields: dict[str, Any] = {"messages": self.messages()}
        if self.max_output_tokens is not None:
            fields["max_tokens"] = self.max_output_tokens
        for name in ("temperature", "top_p", "parallel_tool_calls", "model"):
            if getattr(self, name) is not None:
                fields[name] = getattr(self, name)
        if self.text is not None and self.text.format is not None:
            fields["response_format"] = self.text.format.response_format()
        if self.reasoning is not None and self.reasoning.effort is not None:
            fields["reasoning_effort"] = self.reasoning.effort
        if self.tools:
            fields["tools"] = [{"type": "function", "function": tool.model_dump(exclude_none=True, exclude={"type"})}
                               for tool in self.tools]
        if isinstance(self.tool_choice, NamedFunction):
            fields["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            fields["tool_choice"] = self.tool_choice
        return fields

    def messages(self) -> list[dict[str, Any]]:
        """`instructions` and `input` as chat messages: consecutive function calls are one
        assistant message's tool_calls, their outputs tool messages, a reasoning item the
        next assistant message's reasoning_content."""
        messages = [{"role": "system", "content": self.instructions}] if self.instructions is not None else []
        if isinstance(self.input, str):
            return messages + [{"role": "user", "content": self.input}]
        reasoning = None
        for item in self.input:
            if isinstance(item, ReasoningItem):
                reasoning = "".join(part.text for part in item.content or [])
            elif isinstance(item, FunctionCallOutputItem):
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                    last["tool_calls"].append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call],
                                     **({"reasoning_content": reasoning} if reasoning else {})})
                    reasoning = None
            else:
                message = {"role": item.role, "content": item.text()}
                if item.role == "assistant" and reasoning:
                    message["reasoning_content"], reasoning = reasoning, None
                messages.append(message)
        return messages


def reasoning_item(text: str, status: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def message_item(text: str, status: str) -> dict[str, Any]:
    return {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def function_call_item(call: dict[str, Any], arguments: str, status: str) -> dict[str, Any]:
    """A chat tool call (its id, function name) as an output item with `arguments` so far."""
    return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call["id"],
            "name": call["function"]["name"], "arguments": arguments, "status": status}


def output_items(message: dict[str, Any], is_complete: bool) -> list[dict[str, Any]]:
    """A parsed chat message as Response output items: reasoning, message, function calls."""
    items = []
    status = "completed" if is_complete else "incomplete"
    if message.get("reasoning_content") is not None:
        items.append(reasoning_item(message["reasoning_content"], status))
    if message.get("content") or not message.get("tool_calls"):
        items.append(message_item(message.get("content") or "", status))
    items += [function_call_item(call, call["function"]["arguments"], "completed")
              for call in message.get("tool_calls") or []]
    return items


def response_usage(usage: Usage) -> dict[str, Any]:
    return {"input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens or 0},
            "total_tokens": usage.prompt_tokens + usage.completion_tokens}


def response_object(body: ResponsesBody, model: str, response_id: str, created_at: float,
                    output: list[dict[str, Any]] | None = None, usage: Usage | None = None,
                    status: str = "completed") -> dict[str, Any]:
    """A Response in OpenAI's shape; `status` in_progress (the stream's first events),
    completed or incomplete (max_output_tokens reached)."""
    tool_choice = body.tool_choice.model_dump() if isinstance(body.tool_choice, NamedFunction) \
        else body.tool_choice or "auto"
    return {
        "id": response_id, "object": "response", "created_at": created_at, "model": model, "status": status,
        "output": output or [], "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
        "metadata": body.metadata or {}, "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": None, "store": False,
        "reasoning": body.reasoning.model_dump() if body.reasoning else None,
        "temperature": body.temperature, "top_p": body.top_p, "tool_choice": tool_choice,
        "tools": [tool.model_dump(by_alias=True) for tool in body.tools or []],
        "text": {"format": (body.text.format.model_dump(by_alias=True, exclude_none=True)
                            if body.text and body.text.format else {"type": "text"})},
        "truncation": "disabled", "user": body.user,
        "usage": response_usage(usage) if usage is not None else None,
    }


def new_response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


def finished_response(body: ResponsesBody, model: str, message: dict[str, Any], finish_reason: str,
                      usage: Usage, response_id: str | None = None, created_at: float | None = None) -> dict:
    is_complete = finish_reason != "length"
    return response_object(body, model, response_id or new_response_id(),
                           created_at if created_at is not None else time.time(),
                           output_items(message, is_complete), usage, "completed" if is_complete else "incomplete")
