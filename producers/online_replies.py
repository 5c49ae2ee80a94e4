"""Reply events (jobs/online.py) as OpenAI answers: one JSON body put together from the
events (`Accumulator`), or stream chunks as OpenAI and vLLM send them (`ChunkWriter`).

Both read events through `EventOrder`: one attempt at a time, each event once, in order. An
event of an older attempt (a worker that lost the request) is dropped. A repeated event (a
write sent twice) is dropped; a gap (events the bounded reply stream dropped before they
were read) ends the answer with the reply_lost error.

A newer attempt (a worker that took the request over) continues from the checkpoint of the
tokens before it, and its first event repeats every choice from its start. A non-streaming
answer keeps only the newest attempt's events. A stream has sent part of it already: it
checks the repetition against what the client has, character for character and token for
token, and sends only what is past it (`SentChoice`), so the client's concatenated deltas are
one run's text, with nothing repeated or missing. A repetition that differs (a rerun that
could not be reproduced) ends the stream with the worker_lost error: text of two different
runs is never joined."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from jobs.chat_output import OutputFormat, StreamedMessage
from jobs.online import WORKER_LOST, ChoiceDelta, Done, Error, OnlineEntry, ReplyEvent
from jobs.results import Choice, chat_completion_body, completion_body, usage_of_body
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
        self.output = OutputFormat()

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
            self.output = OutputFormat.from_json(event.output)
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
        usage = usage_of_body(self.usage)
        response = chat_completion_body(model, choices, usage, self.output) if url == CHAT_COMPLETIONS \
            else completion_body(model, choices, usage)
        response["id"] = response_id(entry, url)
        return response


class Diverged(Exception):
    """A newer attempt's repetition differs from what the client has."""


def num_logprob_tokens(logprobs: dict | None) -> int:
    """Tokens an OpenAI logprobs object covers (chat: content; completions: tokens)."""
    return 0 if logprobs is None else len(logprobs.get("content") or logprobs.get("tokens") or [])


def skip_logprobs(logprobs: dict | None, count: int) -> dict | None:
    """`logprobs` without its first `count` tokens (every list in it is per token)."""
    if logprobs is None or not count:
        return logprobs
    return {key: value[count:] if isinstance(value, list) else value for key, value in logprobs.items()}


@dataclass
class SentChoice:
    """What the client has of one streamed choice, and how much of it the current attempt has
    repeated: an attempt that took the request over repeats the choice from its start."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)  # where the worker sends token ids
    num_logprobs: int = 0  # tokens whose logprobs went out
    is_finished: bool = False
    repeated_text: int = 0  # characters of `text` the current attempt has repeated
    repeated_ids: int = 0
    repeated_logprobs: int = 0

    def restart(self) -> None:
        """A new attempt begins: it repeats this choice from the start."""
        self.repeated_text = self.repeated_ids = self.repeated_logprobs = 0

    def take(self, choice: ChoiceDelta) -> ChoiceDelta | None:
        """The part of `choice` the client does not have yet (None: nothing); Diverged if the
        part it repeats differs from what the client has."""
        is_repeating = (self.repeated_text < len(self.text) or self.repeated_ids < len(self.token_ids)
                        or self.repeated_logprobs < self.num_logprobs)
        text = self._past_repeat(choice.text)
        token_ids = choice.token_ids
        if token_ids is not None:
            k = min(len(token_ids), len(self.token_ids) - self.repeated_ids)
            if token_ids[:k] != self.token_ids[self.repeated_ids:self.repeated_ids + k]:
                raise Diverged
            token_ids = token_ids[k:]
            self.repeated_ids += k
            self.token_ids += token_ids
            self.repeated_ids += len(token_ids)
        skip = min(num_logprob_tokens(choice.logprobs), self.num_logprobs - self.repeated_logprobs)
        logprobs = skip_logprobs(choice.logprobs, skip)
        new_logprobs = num_logprob_tokens(logprobs)
        self.repeated_logprobs += skip + new_logprobs
        self.num_logprobs += new_logprobs
        if self.is_finished or is_repeating and not (text or token_ids or new_logprobs or choice.finish_reason):
            return None  # a repeat only, or a choice the client has whole
        self.is_finished = choice.finish_reason is not None
        return ChoiceDelta(choice.index, text, choice.finish_reason, logprobs if new_logprobs else None, token_ids)

    def _past_repeat(self, text: str) -> str:
        k = min(len(text), len(self.text) - self.repeated_text)
        if not self.text.startswith(text[:k], self.repeated_text):
            raise Diverged
        self.repeated_text += len(text)
        self.text += text[k:]
        return text[k:]


class ChunkWriter:
    """Reply events -> OpenAI stream chunks (`chat.completion.chunk` or `text_completion`)."""

    def __init__(self, entry: OnlineEntry, model: str, url: str, include_usage: bool) -> None:
        self.is_chat = url == CHAT_COMPLETIONS
        self.include_usage = include_usage
        self.head = {"id": response_id(entry, url), "object": "chat.completion.chunk" if self.is_chat
                     else "text_completion", "created": int(entry.enqueued_at), "model": model}
        self.opened_choices: set[int] = set()  # chat choices whose role chunk went out
        self.order = EventOrder()
        self.sent: dict[int, SentChoice] = {}  # choice index -> what the client has of it
        self.output = OutputFormat()  # how the answer's text is read (the worker says, with each delta)
        self.messages: dict[int, StreamedMessage] = {}  # choice index -> what the client has of its parse
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
        if place == EventOrder.GAP:
            self.is_ended = True  # never skip text
            return self.error_chunks(APIError(500, REPLY_LOST[1], REPLY_LOST[0], kind="server_error"))
        if place == EventOrder.NEW_ATTEMPT:  # a worker took the request over: it repeats each choice first
            for sent in self.sent.values():
                sent.restart()
        if event.is_last:
            self.is_ended = self.is_complete = True
        if isinstance(event, Error):
            return self.error_chunks(event_error(event))
        if isinstance(event, Done):
            return self.done_chunks(event)
        chunks = []
        self.output = OutputFormat.from_json(event.output)  # a Delta: errors and dones have returned
        for choice in event.choices:
            try:
                new = self.sent.setdefault(choice.index, SentChoice()).take(choice)
            except Diverged:  # never join another run's text to what was sent
                self.is_ended = True
                return chunks + self.error_chunks(APIError(500, WORKER_LOST[1], WORKER_LOST[0], kind="server_error"))
            if new is not None:
                chunks += self._choice_chunks(new)
        return chunks

    def error_chunks(self, error: APIError) -> list[dict[str, Any]]:
        return [error_body(error.message, error.kind, error.code)]

    def done_chunks(self, event: Done) -> list[dict[str, Any]]:
        return [self._chunk([], usage=event.usage)] if self.include_usage else []

    def encode(self, chunk: dict[str, Any] | str) -> bytes:
        return sse(chunk)

    def end(self) -> list[bytes]:
        """What closes the stream: OpenAI's [DONE]."""
        return [sse("[DONE]")]

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
        if self.output.is_plain:
            chunks.append(self._chunk([{"index": choice.index, "delta": {"content": choice.text},
                                        "logprobs": choice.logprobs, "finish_reason": choice.finish_reason,
                                        **extra}]))
            return chunks
        return chunks + self._parsed_chunks(choice, extra)

    def _parsed_chunks(self, choice: ChoiceDelta, extra: dict) -> list[dict[str, Any]]:
        """A parsed choice's deltas (reasoning_content, content, whole tool calls) from the text the
        client has; this event's logprobs ride on the first, the finish reason on the last."""
        message = self.messages.setdefault(choice.index, StreamedMessage())
        is_final = choice.finish_reason is not None
        deltas = message.delta(self.output, self.sent[choice.index].text, is_final) or (
            [{"content": ""}] if is_final or choice.logprobs else [])
        finish_reason = "tool_calls" if choice.finish_reason == "stop" and message.num_calls else choice.finish_reason
        return [self._chunk([{"index": choice.index, "delta": delta,
                              "logprobs": choice.logprobs if position == 0 else None,
                              "finish_reason": finish_reason if position == len(deltas) - 1 else None,
                              **(extra if position == 0 else {})}])
                for position, delta in enumerate(deltas)]
