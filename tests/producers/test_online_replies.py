"""Reply events of several attempts (a worker died, another took the request over and
continued it from its checkpoint) become one answer: a stream sends what is past the text
the client has, and never joins the text of two different runs."""

from __future__ import annotations

import pytest

from jobs.chat_output import OutputFormat
from jobs.online import ChoiceDelta, Delta, Done, Error, OnlineEntry
from jobs.schemas import CHAT_COMPLETIONS, COMPLETIONS, OnlineChatBody, OnlineCompletionBody
from producers.errors import APIError
from producers.online_replies import Accumulator, ChunkWriter

ENTRY = OnlineEntry("r1", COMPLETIONS, {}, True, 0, deadline=2e9, enqueued_at=1.7e9)
USAGE = {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}


def delta(text: str, attempt: int, finish_reason: str | None = None) -> Delta:
    return Delta([ChoiceDelta(0, text, finish_reason)], attempt)


def body(stream: bool) -> OnlineCompletionBody:
    return OnlineCompletionBody(model="m", prompt="p", stream=stream)


def test_a_non_streaming_answer_is_exactly_the_newest_attempt():
    answer = Accumulator(body(stream=False))
    assert not answer.add([delta("Once upon", 1), delta(" a", 1)])
    # The first worker died; the second runs it again. A straggler of the first is dropped.
    assert not answer.add([delta("Once", 2), delta(" upon", 1), delta(" upon a time", 2)])
    assert answer.add([delta("", 2, "length"), Done(USAGE, 2)])
    result = answer.body(ENTRY, "m", COMPLETIONS)
    assert result["choices"][0]["text"] == "Once upon a time"
    assert result["choices"][0]["finish_reason"] == "length" and result["usage"]["completion_tokens"] == 3


def test_an_error_of_the_current_attempt_raises_and_one_of_an_old_attempt_does_not():
    answer = Accumulator(body(stream=False))
    answer.add([delta("a", 2)])
    assert not answer.add([Error(500, "worker_lost", "old", 1)])
    with pytest.raises(APIError) as raised:
        answer.add([Error(400, "invalid_request", "bad", 2)])
    assert (raised.value.status, raised.value.code) == (400, "invalid_request")


def texts(chunks: list[dict]) -> list[str]:
    return [c["choices"][0]["text"] for c in chunks]


def test_a_stream_continues_past_what_the_client_has_when_another_attempt_takes_over():
    chunks = ChunkWriter(ENTRY, "m", COMPLETIONS, include_usage=False)
    assert texts(chunks.of(delta("Once", 1)) + chunks.of(delta(" upon", 1))) == ["Once", " upon"]
    # The heir resumed from a checkpoint at "Once": its first delta repeats it, then it catches up.
    assert chunks.of(delta("Once", 2)) == []
    assert chunks.of(delta(" up", 2)) == []
    assert texts(chunks.of(delta("on a", 2))) == [" a"]
    assert chunks.of(delta(" long", 1)) == []  # a straggler of the first worker
    assert texts(chunks.of(delta(" time", 2, "length"))) == [" time"]
    assert chunks.of(Done(USAGE, 2)) == [] and chunks.is_complete


def test_a_repetition_that_differs_ends_the_stream_with_worker_lost():
    chunks = ChunkWriter(ENTRY, "m", COMPLETIONS, include_usage=False)
    assert texts(chunks.of(delta("Once upon", 1))) == ["Once upon"]
    assert chunks.of(delta("Once", 2)) == []
    [error] = chunks.of(delta(" in", 2))  # an unseeded rerun without a checkpoint: another text
    assert error["error"]["code"] == "worker_lost" and chunks.is_ended and not chunks.is_complete


def completion_logprobs(tokens: list[str], start: int) -> dict:
    offsets = [start + sum(map(len, tokens[:i])) for i in range(len(tokens))]
    return {"tokens": tokens, "token_logprobs": [-1.0] * len(tokens), "top_logprobs": [{t: -1.0} for t in tokens],
            "text_offset": offsets}


def test_a_continued_stream_sends_each_token_s_logprobs_and_each_choice_s_end_once():
    chunks = ChunkWriter(ENTRY, "m", COMPLETIONS, include_usage=False)
    first = Delta([ChoiceDelta(0, "ab", None, completion_logprobs(["a", "b"], 0)),
                   ChoiceDelta(1, "x", "stop", completion_logprobs(["x"], 0))], 1, 1)
    assert len(chunks.of(first)) == 2
    # The heir's checkpoint held "a" and the finished choice 1; it repeats both, then goes on.
    again = Delta([ChoiceDelta(0, "a", None, completion_logprobs(["a"], 0)),
                   ChoiceDelta(1, "x", "stop", completion_logprobs(["x"], 0))], 2, 1)
    assert chunks.of(again) == []
    [chunk] = chunks.of(Delta([ChoiceDelta(0, "bcd", "length", completion_logprobs(["b", "cd"], 1))], 2, 2))
    choice = chunk["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == ("cd", "length")
    assert choice["logprobs"]["tokens"] == ["cd"] and choice["logprobs"]["text_offset"] == [2]


def test_token_ids_of_a_tokenizer_less_worker_continue_without_repeats():
    chunks = ChunkWriter(ENTRY, "m", COMPLETIONS, include_usage=False)
    ids = lambda ids, attempt: Delta([ChoiceDelta(0, "", None, None, ids)], attempt)  # noqa: E731
    assert [c["choices"][0]["token_ids"] for c in chunks.of(ids([5, 6, 7], 1))] == [[5, 6, 7]]
    assert chunks.of(ids([5, 6], 2)) == []
    assert [c["choices"][0]["token_ids"] for c in chunks.of(ids([7, 8], 2))] == [[8]]
    [error] = chunks.of(Delta([ChoiceDelta(0, "", None, None, [5, 9])], 3))
    assert error["error"]["code"] == "worker_lost"


def test_a_stream_follows_a_new_attempt_when_nothing_was_sent_yet():
    chunks = ChunkWriter(ENTRY, "m", COMPLETIONS, include_usage=True)
    assert texts(chunks.of(delta("", 1))) == [""]  # an empty first delta shows no text
    assert [c["choices"][0]["text"] for c in chunks.of(delta("Hi", 2))] == ["Hi"]
    assert chunks.of(delta("stale", 1)) == []
    [last] = chunks.of(Done(USAGE, 2))
    assert last["usage"] == USAGE and chunks.is_ended and chunks.is_complete


def numbered(text: str, seq: int, attempt: int = 1) -> Delta:
    return Delta([ChoiceDelta(0, text)], attempt, seq)


def test_a_repeated_event_is_dropped_and_a_gap_ends_the_answer_with_reply_lost():
    answer = Accumulator(body(stream=False))
    assert not answer.add([numbered("a", 1), numbered("b", 2), numbered("b", 2), numbered("c", 3)])
    assert answer.add([Done(USAGE, 1, 4)])
    assert answer.body(ENTRY, "m", COMPLETIONS)["choices"][0]["text"] == "abc"  # the repeat of "b" dropped
    lagging = Accumulator(body(stream=False))
    with pytest.raises(APIError) as raised:
        lagging.add([numbered("a", 1), numbered("d", 4)])  # 2 and 3 were trimmed before they were read
    assert (raised.value.status, raised.value.code) == (500, "reply_lost")
    chunks = ChunkWriter(ENTRY, "m", COMPLETIONS, include_usage=False)
    assert [c["choices"][0]["text"] for e in (numbered("a", 1), numbered("a", 1), numbered("b", 2))
            for c in chunks.of(e)] == ["a", "b"]
    [error] = chunks.of(numbered("z", 9))
    assert error["error"]["code"] == "reply_lost" and chunks.is_ended and not chunks.is_complete


def test_a_stream_s_cleanup_runs_when_the_client_leaves_before_its_first_chunk():
    import asyncio
    import threading

    from starlette.requests import ClientDisconnect

    from producers.routes.online import ReplyStream

    started, cleaned = [], threading.Event()

    async def chunks():
        started.append(True)
        yield b"data: {}\n\n"

    async def receive():
        await asyncio.sleep(3600)

    async def send(message):
        raise OSError("the client is gone")  # before the headers: the generator never starts

    async def scenario():
        with pytest.raises((OSError, ClientDisconnect)):
            await ReplyStream(chunks(), cleaned.set)({"type": "http", "asgi": {"spec_version": "2.4"}}, receive,
                                                     send)

    asyncio.run(scenario())
    assert cleaned.wait(5) and not started


THINKING = OutputFormat("qwen3", "hermes", phase="undecided").to_json()
ANSWER = ('<think>\nThe river is wide\n</think>\n\nYes.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n'
          "</tool_call>")


def parsed_delta(text: str, attempt: int, finish_reason: str | None = None) -> Delta:
    return Delta([ChoiceDelta(0, text, finish_reason)], attempt, output=THINKING)


@pytest.mark.parametrize("cut", [3, 12, 40, 60, 80])
def test_a_taken_over_stream_keeps_its_parse(cut):
    """A worker dies after `cut` characters; the heir repeats the text from the start and goes on.
    The client reads each of reasoning, content and tool call once, as one run would give them."""
    chunks = ChunkWriter(OnlineEntry("r1", CHAT_COMPLETIONS, {}, True, 0, 2e9, 1.7e9), "m", CHAT_COMPLETIONS,
                         include_usage=False)
    sent = chunks.of(parsed_delta(ANSWER[:cut], 1))
    sent += chunks.of(parsed_delta(ANSWER[:cut // 2], 2)) + chunks.of(parsed_delta(ANSWER[cut // 2:], 2, "stop"))
    deltas = [chunk["choices"][0]["delta"] for chunk in sent]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "The river is wide"
    assert "".join(d.get("content") or "" for d in deltas) == "Yes.\n"
    calls = [call for d in deltas for call in d.get("tool_calls", [])]
    assert [(c["index"], c["function"]["name"], c["function"]["arguments"]) for c in calls] == [(0, "f", '{"x": 1}')]
    assert sent[-1]["choices"][0]["finish_reason"] == "tool_calls"
    answer = Accumulator(OnlineChatBody(model="m", messages=[{"role": "user", "content": "q"}]))
    answer.add([parsed_delta(ANSWER[:cut], 1), parsed_delta(ANSWER, 2, "stop"), Done(USAGE, 2)])
    message = answer.body(ENTRY, "m", CHAT_COMPLETIONS)["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"], message["tool_calls"][0]["function"]["name"]) == (
        "The river is wide", "Yes.\n", "f")
