"""`/v1/responses` answers: the Response object of a finished request, and its stream of
events as OpenAI names them.

    response.created, response.in_progress
    per output item, in order:
      reasoning      output_item.added, reasoning_text.delta..., reasoning_text.done, output_item.done
      message        output_item.added, content_part.added, output_text.delta..., output_text.done,
                     content_part.done, output_item.done
      function_call  output_item.added, function_call_arguments.delta, ...arguments.done, output_item.done
    response.completed (or response.incomplete at max_output_tokens); a failure is an `error` event

The text is read as the chat answer it is (jobs/chat_output.py): the reply events, their order
and a taken-over request's repetition are `ChunkWriter`'s.
"""

from __future__ import annotations

import json
from typing import Any

from jobs.chat_output import StreamedMessage
from jobs.online import ChoiceDelta, Done, OnlineEntry
from jobs.responses import (
    ResponsesBody,
    finished_response,
    function_call_item,
    message_item,
    reasoning_item,
    response_object,
)
from jobs.results import Choice, chat_choice, usage_of_body
from producers.errors import APIError
from producers.online_replies import Accumulator, ChunkWriter


def response_id(entry: OnlineEntry) -> str:
    return f"resp_{entry.request_id}"


def finished_body(accumulator: Accumulator, entry: OnlineEntry, model: str, body: ResponsesBody) -> dict[str, Any]:
    """A non-streaming answer: the Response of the one choice."""
    usage = usage_of_body(accumulator.usage)
    chat = chat_choice(0, Choice(accumulator.texts[0], accumulator.finish_reasons[0] or "stop"), accumulator.output)
    return finished_response(body, model, chat["message"], chat["finish_reason"], usage, response_id(entry),
                             entry.enqueued_at)


class ResponseEventWriter(ChunkWriter):
    """Reply events -> Responses stream events."""

    def __init__(self, entry: OnlineEntry, model: str, body: ResponsesBody) -> None:
        super().__init__(entry, model, "/v1/responses", include_usage=False)
        self.body, self.model, self.id, self.created_at = body, model, response_id(entry), entry.enqueued_at
        self.sequence_number = 0
        self.items: list[dict[str, Any]] = []  # the output so far; the last may be open
        self.is_open = False  # the last item still takes deltas
        self.message = StreamedMessage()
        self.finish_reason: str | None = None

    def event(self, kind: str, **fields) -> dict[str, Any]:
        event = {"type": kind, **fields, "sequence_number": self.sequence_number}
        self.sequence_number += 1
        return event

    def encode(self, chunk: dict[str, Any] | str) -> bytes:
        return f"event: {chunk['type']}\ndata: {json.dumps(chunk, separators=(',', ':'))}\n\n".encode()

    def end(self) -> list[bytes]:
        return []  # the Responses stream ends with its last event, no [DONE]

    def opening(self) -> list[dict[str, Any]]:
        if self.sequence_number:
            return []
        response = response_object(self.body, self.model, self.id, self.created_at, status="in_progress")
        return [self.event("response.created", response=response),
                self.event("response.in_progress", response=response)]

    def error_chunks(self, error: APIError) -> list[dict[str, Any]]:
        return self.opening() + [self.event("error", code=error.code, message=error.message, param=error.param)]

    def done_chunks(self, event: Done) -> list[dict[str, Any]]:
        events = self.opening() + self.close_item()
        status = "incomplete" if self.finish_reason == "length" else "completed"
        response = response_object(self.body, self.model, self.id, self.created_at, self.items,
                                   usage_of_body(event.usage), status)
        return events + [self.event(f"response.{status}", response=response)]

    def _choice_chunks(self, choice: ChoiceDelta) -> list[dict[str, Any]]:
        events = self.opening()
        self.finish_reason = choice.finish_reason or self.finish_reason
        for delta in self.message.delta(self.output, self.sent[choice.index].text, choice.finish_reason is not None):
            if "reasoning_content" in delta:
                events += self.text_delta("reasoning", delta["reasoning_content"])
            elif "content" in delta:
                events += self.text_delta("message", delta["content"])
            else:
                events += self.function_call(delta["tool_calls"][0])
        return events

    def text_delta(self, kind: str, text: str) -> list[dict[str, Any]]:
        events = []
        if not (self.is_open and self.items[-1]["type"] == kind):
            events += self.close_item() + self.open_item(kind)
        item, index = self.items[-1], len(self.items) - 1
        item["content"][0]["text"] += text
        if kind == "reasoning":
            return events + [self.event("response.reasoning_text.delta", item_id=item["id"], output_index=index,
                                        content_index=0, delta=text)]
        return events + [self.event("response.output_text.delta", item_id=item["id"], output_index=index,
                                    content_index=0, delta=text, logprobs=[])]

    def open_item(self, kind: str) -> list[dict[str, Any]]:
        item = reasoning_item("", "in_progress") if kind == "reasoning" else message_item("", "in_progress")
        self.items.append(item)
        self.is_open = True
        index = len(self.items) - 1
        added = {**item, "content": []}
        events = [self.event("response.output_item.added", output_index=index, item=added)]
        if kind == "message":
            events.append(self.event("response.content_part.added", item_id=item["id"], output_index=index,
                                     content_index=0, part={"type": "output_text", "text": "", "annotations": []}))
        return events

    def close_item(self) -> list[dict[str, Any]]:
        if not self.is_open:
            return []
        self.is_open = False
        item, index = self.items[-1], len(self.items) - 1
        item["status"] = "incomplete" if self.finish_reason == "length" else "completed"
        text = item["content"][0]["text"]
        if item["type"] == "reasoning":
            events = [self.event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                 content_index=0, text=text)]
        else:
            events = [self.event("response.output_text.done", item_id=item["id"], output_index=index,
                                 content_index=0, text=text, logprobs=[]),
                      self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                 content_index=0, part=item["content"][0])]
        return events + [self.event("response.output_item.done", output_index=index, item=item)]

    def function_call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        events = self.close_item()
        function = call["function"]
        item = function_call_item(call, "", "in_progress")
        self.items.append(item)
        index = len(self.items) - 1
        events.append(self.event("response.output_item.added", output_index=index, item=dict(item)))
        item["arguments"], item["status"] = function["arguments"], "completed"
        return events + [
            self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                       delta=function["arguments"]),
            self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                       name=function["name"], arguments=function["arguments"]),
            self.event("response.output_item.done", output_index=index, item=item)]
