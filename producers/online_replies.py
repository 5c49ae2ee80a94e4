"""Reply events (jobs/online.py) as OpenAI answers: one JSON body put together from the
events (`Accumulator`), or stream chunks as OpenAI and vLLM send them (`ChunkWriter`).

Both read events through `EventOrder`: one attempt at a time, each event once, in order. An
event of an older attempt (a worker that lost the request) is dropped; a newer attempt
replaces what a non-streaming answer had gathered, and ends a stream that already sent
tokens with the worker_lost error. Text of two attempts is never joined. A repeated event
(a write sent twice) is dropped; a gap (events the bounded reply stream dropped before they
were read) ends the answer with the reply_lost error."""

from __future__ import annotations

import json
from typing import Any

from jobs.online import WORKER_LOST, ChoiceDelta, Done, Error, OnlineEntry, ReplyEvent
from jobs.results import Choice, Usage, chat_completion_body, completion_body
from jobs.schemas import CHAT_COMPLETIONS, OnlineFields
from producers.errors import APIError, error_body


def sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


REPLY_LOST = ("reply_lost", "Part of the answer was lost before it was read (the client read too slowly); "
                           "the output is incomplete. Retry the request.")


class EventOrder:
    """Where an event stands against those read before: OLD (an earlier attempt, or a repeat),
    NEXT, NEW_ATTEMPT (a later attempt's first), or GAP (events in between were lost)."""

    OLD, NEXT, NEW_ATTEMPT, GAP = "old", "next", "new_attempt", "gap"

    def __init__(self) -> None:
        self.attempt = 0
        self.seq = 0

    def place(self, event: ReplyEvent) -> str:
        if event.attempt < self.attempt:
            return self.OLD
        is_new_attempt = event.attempt > self.attempt
        last_seq = 0 if is_new_attempt else self.seq
        if event.seq and event.seq <= last_seq:
            return self.OLD
        if event.seq > last_seq + 1:
            return self.GAP
        self.attempt, self.seq = event.attempt, event.seq or last_seq
        return self.NEW_ATTEMPT if is_new_attempt else self.NEXT


def event_error(event: Error) -> APIError:
    """A worker's error event as the API error it stands for."""
    return APIError(event.status, event.message, event.code,
                    kind="server_error" if event.status >= 500 else "invalid_request_error")


def merge_logprobs(so_far: dict | None, new: dict | None) -> dict | None:
    """Logprobs of consecutive deltas, in OpenAI's shape: lists are concatenated."""
    if new is None:
        return so_far
    if so_far is None:
        return {key: list(value) for key, value in new.items()}
    return {key: so_far[key] + value for key, value in new.items()}


def response_id(entry: OnlineEntry, url: str) -> str:
    return f"{'chatcmpl' if url == CHAT_COMPLETIONS else 'cmpl'}-{entry.request_id}"


class Accumulator:
    """A non-streaming response, put together from the events."""

    def __init__(self, body: OnlineFields) -> None:
        self.num_choices = getattr(body, "n", None) or 1
        self.order = EventOrder()
        self.reset()

    def reset(self) -> None:
        self.texts = [""] * self.num_choices
        self.finish_reasons: list[str | None] = [None] * self.num_choices
        self.logprobs: list[dict | None] = [None] * self.num_choices
        self.token_ids: list[list[int] | None] = [None] * self.num_choices
        self.usage: dict[str, Any] = {}

    def add(self, events: list[ReplyEvent]) -> bool:
        """True once the request has ended (done, or an error that raises)."""
        for event in events:
            place = self.order.place(event)
            if place == EventOrder.OLD:
                continue  # a worker that lost the request, or a repeat
            if place == EventOrder.GAP:
                raise APIError(500, REPLY_LOST[1], REPLY_LOST[0], kind="server_error")
            if place == EventOrder.NEW_ATTEMPT:
                self.reset()  # it runs from the start: keep only this attempt
            if isinstance(event, Error):
                raise event_error(event)
            if isinstance(event, Done):
                self.usage = event.usage
                return True
            for choice in event.choices:
                self._add_choice(choice)
        return False

    def _add_choice(self, choice: ChoiceDelta) -> None:
        i = choice.index
        self.texts[i] += choice.text
        self.finish_reasons[i] = choice.finish_reason or self.finish_reasons[i]
        self.logprobs[i] = merge_logprobs(self.logprobs[i], choice.logprobs)
        if choice.token_ids is not None:
            self.token_ids[i] = (self.token_ids[i] or []) + choice.token_ids

    def body(self, entry: OnlineEntry, model: str, url: str) -> dict[str, Any]:
        choices = [Choice(text, reason or "stop", logprobs, ids) for text, reason, logprobs, ids in
                   zip(self.texts, self.finish_reasons, self.logprobs, self.token_ids)]
        usage = Usage(self.usage.get("prompt_tokens", 0), self.usage.get("completion_tokens", 0),
                      self.usage.get("prompt_tokens_details", {}).get("cached_tokens", 0))
        build = chat_completion_body if url == CHAT_COMPLETIONS else completion_body
        response = build(model, choices, usage)
        response["id"] = response_id(entry, url)
        return response


class ChunkWriter:
    """Reply events -> OpenAI stream chunks (`chat.completion.chunk` or `text_completion`)."""

    def __init__(self, entry: OnlineEntry, model: str, url: str, include_usage: bool) -> None:
        self.is_chat = url == CHAT_COMPLETIONS
        self.include_usage = include_usage
        self.head = {"id": response_id(entry, url), "object": "chat.completion.chunk" if self.is_chat
                     else "text_completion", "created": int(entry.enqueued_at), "model": model}
        self.opened_choices: set[int] = set()  # chat choices whose role chunk went out
        self.order = EventOrder()
        self.has_sent_tokens = False
        self.is_ended = False  # the last event went out: a done, an error, or worker_lost
        self.is_complete = False  # the request itself ended (nothing left to cancel)

    def _chunk(self, choices: list[dict], **extra) -> dict[str, Any]:
        chunk = {**self.head, "choices": choices, **extra}
        if self.include_usage and "usage" not in chunk:
            chunk["usage"] = None  # as OpenAI: every chunk has the field, only the last one fills it
        return chunk

    def of(self, event: ReplyEvent) -> list[dict[str, Any]]:
        """The chunks of one event; `is_ended` once the stream must end."""
        place = self.order.place(event)
        if place == EventOrder.OLD:
            return []  # a worker that lost the request, or a repeat
        if place == EventOrder.GAP or place == EventOrder.NEW_ATTEMPT and self.has_sent_tokens:
            self.is_ended = True  # never skip text, never join another run to what was sent
            code, message = REPLY_LOST if place == EventOrder.GAP else WORKER_LOST
            return [error_body(message, "server_error", code)]
        if event.is_last:
            self.is_ended = self.is_complete = True
        if isinstance(event, Error):
            error = event_error(event)
            return [error_body(error.message, error.kind, error.code)]
        if isinstance(event, Done):
            return [self._chunk([], usage=event.usage)] if self.include_usage else []
        chunks = []
        for choice in event.choices:
            self.has_sent_tokens = self.has_sent_tokens or bool(choice.text or choice.token_ids)
            chunks += self._choice_chunks(choice)
        return chunks

    def _choice_chunks(self, choice: ChoiceDelta) -> list[dict[str, Any]]:
        extra = {"token_ids": choice.token_ids} if choice.token_ids is not None else {}
        if not self.is_chat:
            return [self._chunk([{"index": choice.index, "text": choice.text, "logprobs": choice.logprobs,
                                  "finish_reason": choice.finish_reason, **extra}])]
        chunks = []
        if choice.index not in self.opened_choices:  # vLLM and OpenAI open each choice with the role
            self.opened_choices.add(choice.index)
            chunks.append(self._chunk([{"index": choice.index, "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None}]))
        chunks.append(self._chunk([{"index": choice.index, "delta": {"content": choice.text},
                                    "logprobs": choice.logprobs, "finish_reason": choice.finish_reason, **extra}]))
        return chunks
