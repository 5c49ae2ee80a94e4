"""Function tools in request bodies, OpenAI's fields: `tools`, `tool_choice`,
`parallel_tool_calls`, and the tool calls and tool results of a conversation.

A forced choice (`required`, or a named function) is enforced by a grammar, as vLLM does: a
named function's output is a JSON object valid for its parameters; `required` outputs a list
of {"name", "parameters"}, one item with parallel_tool_calls false. Under `auto` the model's
chat template shows the tools and its tool parser reads the calls (jobs/tool_calls.py).
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, StrictBool, WithJsonSchema, field_validator

from jobs.constraints import StrictModel, check_json_schema, check_schema_size

MAX_TOOLS = 128
MAX_TOOL_CALLS = 128  # in one assistant message of a conversation
MAX_ARGUMENTS_CHARS = 1_000_000
MAX_TEMPLATE_KWARGS = 32
MAX_TEMPLATE_KWARGS_CHARS = 100_000
TEMPLATE_KWARGS_SCHEMA = {"type": "object", "maxProperties": MAX_TEMPLATE_KWARGS,
                          "propertyNames": {"pattern": "^[A-Za-z_][A-Za-z0-9_]{0,63}$"},
                          "description": "variables for the chat template, such as enable_thinking"}
# OpenAI's values; templates get gpt-oss's three (workers/chat_parsers.py), and "none" turns a
# Qwen3's thinking off.
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]
FunctionName = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]
ToolSchema = Annotated[dict[str, Any], BeforeValidator(check_schema_size)]


class FunctionDefinition(StrictModel):
    name: FunctionName
    description: Annotated[str, Field(max_length=100_000)] | None = None
    parameters: ToolSchema | None = None
    strict: StrictBool | None = None

    def parameters_schema(self) -> dict[str, Any]:
        return self.parameters if self.parameters is not None else {"type": "object"}


class Tool(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName_(StrictModel):
    name: FunctionName


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: FunctionName_


class ToolCallFunction(StrictModel):
    name: FunctionName
    arguments: Annotated[str, Field(max_length=MAX_ARGUMENTS_CHARS)]


class AssistantToolCall(StrictModel):
    id: Annotated[str, Field(min_length=1, max_length=256)]
    type: Literal["function"]
    function: ToolCallFunction

    def template_form(self) -> dict[str, Any]:
        """As chat templates expect a call: arguments as an object (they write `arguments | tojson`);
        arguments that are not a JSON object stay text."""
        try:
            arguments = json.loads(self.function.arguments)
        except json.JSONDecodeError:
            arguments = self.function.arguments
        return {"id": self.id, "type": "function", "function": {"name": self.function.name, "arguments": arguments}}


def check_template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
    """Extra variables for the chat template (enable_thinking, ...): names, and bounded."""
    if not isinstance(kwargs, dict):
        return kwargs  # pydantic names what it should be
    if len(kwargs) > MAX_TEMPLATE_KWARGS:
        raise ValueError(f"at most {MAX_TEMPLATE_KWARGS} variables")
    bad = [name for name in kwargs if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,63}", name)]
    if bad:
        raise ValueError(f"variable names must be identifiers; got {bad[:3]}")
    if len(json.dumps(kwargs)) > MAX_TEMPLATE_KWARGS_CHARS:
        raise ValueError(f"more than {MAX_TEMPLATE_KWARGS_CHARS} characters of JSON")
    check_schema_size(kwargs)  # bounded nesting
    return kwargs


class ToolFields(StrictModel):
    """The tool and template fields of a chat body."""

    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    chat_template_kwargs: Annotated[dict[str, Any], BeforeValidator(check_template_kwargs),
                                    WithJsonSchema(TEMPLATE_KWARGS_SCHEMA)] | None = None
    reasoning_effort: ReasoningEffort | None = None

    @field_validator("tools")
    @classmethod
    def _unique_names(cls, tools: list[Tool] | None) -> list[Tool] | None:
        names = [tool.function.name for tool in tools or []]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ValueError(f"function names must be unique; repeated: {', '.join(duplicates)}")
        return tools

    def forced_tool(self) -> str | None:
        """"required", a named function, or None (auto or none: the model decides, or no tools)."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.function.name
        return "required" if self.tool_choice == "required" else None

    def offered_tools(self) -> list[Tool]:
        """The tools the template shows: none with tool_choice none."""
        return [] if self.tool_choice == "none" else list(self.tools or [])

    def check_tool_choice(self) -> None:
        forced = self.forced_tool()
        names = {tool.function.name: tool for tool in self.tools or []}
        if forced == "required" and not names:
            raise ValueError("tool_choice: required needs tools")
        if forced not in (None, "required") and forced not in names:
            raise ValueError(f"tool_choice: no tool named {forced!r} in tools")
        if forced is not None:
            check_json_schema(self.forced_schema())  # the grammar must enforce it

    def forced_schema(self) -> dict[str, Any]:
        """The JSON schema a forced tool choice's output follows."""
        tools = {tool.function.name: tool.function for tool in self.tools or []}
        forced = self.forced_tool()
        if forced != "required":
            return tools[forced].parameters_schema()
        items = [{"type": "object", "properties": {"name": {"const": name}, "parameters": f.parameters_schema()},
                  "required": ["name", "parameters"], "additionalProperties": False} for name, f in tools.items()]
        schema = {"type": "array", "minItems": 1, "items": items[0] if len(items) == 1 else {"anyOf": items}}
        return {**schema, "maxItems": 1} if self.parallel_tool_calls is False else schema

    def template_tools(self) -> list[dict[str, Any]] | None:
        tools = self.offered_tools()
        return [tool.model_dump(exclude_none=True) for tool in tools] or None
