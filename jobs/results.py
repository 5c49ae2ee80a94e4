"""Result lines in OpenAI's batch output format: a success line with its completion body,
an error line, and the usage both count. Recording them is jobs/recording.py's."""

from __future__ import annotations

import base64
import struct
import time
import uuid
from dataclasses import dataclass
from typing import Any

from jobs.chat_output import OutputFormat, chat_message


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    reasoning_tokens: int | None = None  # set where a reasoning parser reads the output

    def as_openai(self) -> dict[str, Any]:
        usage = {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                 "total_tokens": self.prompt_tokens + self.completion_tokens,
                 "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}
        if self.reasoning_tokens is not None:
            usage["completion_tokens_details"] = {"reasoning_tokens": self.reasoning_tokens}
        return usage


@dataclass
class Choice:
    text: str
    finish_reason: str
    logprobs: dict[str, Any] | None = None
    token_ids: list[int] | None = None  # set by workers without a tokenizer (vLLM's return_token_ids field)

    def extra(self) -> dict[str, Any]:
        return {} if self.token_ids is None else {"token_ids": self.token_ids}


def completion_body(model: str, choices: list[Choice], usage: Usage) -> dict[str, Any]:
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": model, "usage": usage.as_openai(),
            "choices": [{"index": i, "text": c.text, "finish_reason": c.finish_reason, "logprobs": c.logprobs,
                         **c.extra()} for i, c in enumerate(choices)]}


def chat_choice(index: int, choice: Choice, output: OutputFormat) -> dict[str, Any]:
    """One chat choice: its message read by the request's parsers; a stop that called tools
    ends with finish_reason tool_calls, as OpenAI's."""
    message, calls_tools = chat_message(output, choice.text)
    finish_reason = "tool_calls" if calls_tools and choice.finish_reason == "stop" else choice.finish_reason
    return {"index": index, "message": message, "finish_reason": finish_reason, "logprobs": choice.logprobs,
            **choice.extra()}


def chat_completion_body(model: str, choices: list[Choice], usage: Usage,
                         output: OutputFormat | None = None) -> dict[str, Any]:
    output = output or OutputFormat()
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": model, "usage": usage.as_openai(),
            "choices": [chat_choice(i, c, output) for i, c in enumerate(choices)]}


def encode_embedding(embedding: list[float], encoding_format: str | None) -> list[float] | str:
    """A vector as OpenAI returns it: floats, or base64 of little-endian float32."""
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(embedding)}f", *embedding)).decode("ascii")
    return embedding


def embedding_body(model: str, embeddings: list[list[float]], encoding_format: str | None,
                   num_prompt_tokens: int) -> dict[str, Any]:
    """OpenAI's embeddings response: one entry per input, in input order."""
    return {"object": "list", "model": model,
            "data": [{"object": "embedding", "index": i, "embedding": encode_embedding(e, encoding_format)}
                     for i, e in enumerate(embeddings)],
            "usage": {"prompt_tokens": num_prompt_tokens, "total_tokens": num_prompt_tokens}}


def success_line(custom_id: str, body: dict[str, Any]) -> dict[str, Any]:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id,
            "response": {"status_code": 200, "request_id": uuid.uuid4().hex, "body": body}, "error": None}


def error_line(custom_id: str, code: str, message: str) -> dict[str, Any]:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message}}


def usage_of(line: dict[str, Any]) -> Usage:
    """The usage a result line reports (none for an error line)."""
    return usage_of_body(((line.get("response") or {}).get("body") or {}).get("usage") or {})


def usage_of_body(usage: dict[str, Any]) -> Usage:
    """OpenAI's usage object (chat and completions) as a Usage."""
    return Usage(usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0),
                 (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
                 (usage.get("completion_tokens_details") or {}).get("reasoning_tokens"))


def is_error_line(line: dict[str, Any]) -> bool:
    return line.get("error") is not None or (line.get("response") or {}).get("status_code", 200) >= 400
