"""Chat messages in request bodies, one model per role (so the OpenAPI schema says which fields
go with which), and each as a chat template reads it (Hugging Face's convention)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag

from jobs.constraints import StrictModel as _Strict
from jobs.tools import MAX_TOOL_CALLS, AssistantToolCall

MAX_PROMPT_CHARS = 1_000_000
MAX_MESSAGES = 1024
ShortStr = Annotated[str, Field(max_length=256)]


class TextPart(_Strict):
    type: Literal["text"]
    text: Annotated[str, Field(max_length=MAX_PROMPT_CHARS)]


MessageContent = Annotated[str, Field(max_length=MAX_PROMPT_CHARS)] | Annotated[list[TextPart], Field(max_length=64)]


class _Message(_Strict):
    content: MessageContent
    name: ShortStr | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)

    def template_form(self) -> dict[str, Any]:
        """The message as chat templates read it (Hugging Face's convention)."""
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            message["name"] = self.name
        return message


class InstructionMessage(_Message):
    role: Literal["system", "developer", "user"]


class AssistantMessage(_Message):
    role: Literal["assistant"]
    content: MessageContent | None = None  # none beside tool_calls
    tool_calls: Annotated[list[AssistantToolCall], Field(max_length=MAX_TOOL_CALLS)] | None = None
    reasoning_content: Annotated[str, Field(max_length=MAX_PROMPT_CHARS)] | None = None  # vLLM's

    def template_form(self) -> dict[str, Any]:
        message = super().template_form()
        if self.reasoning_content is not None:  # Qwen3's templates read it so; gpt-oss's as `thinking`
            message["reasoning_content"] = message["thinking"] = self.reasoning_content
        if self.tool_calls:
            message["tool_calls"] = [call.template_form() for call in self.tool_calls]
        return message


class ToolMessage(_Message):
    role: Literal["tool"]
    tool_call_id: Annotated[str, Field(min_length=1, max_length=256)]

    def template_form(self) -> dict[str, Any]:
        return {**super().template_form(), "tool_call_id": self.tool_call_id}


def _role_tag(value) -> str | None:
    role = value.get("role") if isinstance(value, dict) else getattr(value, "role", None)
    if not isinstance(role, str):
        return None  # pydantic names the field
    kind = {"system": "instruction", "developer": "instruction", "user": "instruction"}.get(role, role)
    return f"role-{kind}" if kind in ("instruction", "assistant", "tool") else None


# One model per role, so the OpenAPI schema says which fields go with which (a tool result names
# its call; an assistant message may carry calls instead of content).
ChatMessage = Annotated[Annotated[InstructionMessage, Tag("role-instruction")]
                        | Annotated[AssistantMessage, Tag("role-assistant")] | Annotated[ToolMessage, Tag("role-tool")],
                        Discriminator(_role_tag, custom_error_type="invalid_role",
                                      custom_error_message="role: must be system, developer, user, assistant or tool")]
