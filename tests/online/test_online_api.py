"""Online /v1/completions and /v1/chat/completions through the queue, driven by the
official `openai` client (sync, async, streaming) against a real worker loop."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import jsonschema
import openai
import pytest

from engine import SamplingParams
from jobs import batches, heartbeats, keys, online
from producers.ingest import submit
from tests.online.conftest import MODEL, WorkerThread

PROMPT = "The fleet reads the queue and"
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is a KV cache?"}]


def greedy(reference, prompt, max_tokens: int = 16, **options):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, **options)
    return reference.generate([prompt], params, use_tqdm=False)[0]


def chat_token_ids(reference, messages) -> list[int]:
    """The chat template rendering batch lines use (workers/translate.py)."""
    return reference.get_tokenizer().apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                         return_dict=False)


def test_greedy_completion_equals_llm_generate_with_exact_usage(worker, client, reference):
    expected = greedy(reference, PROMPT)
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0)
    assert response.object == "text_completion" and response.model == MODEL
    assert response.choices[0].text == expected.text
    assert response.choices[0].finish_reason == expected.finish_reason
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert response.usage.completion_tokens == len(expected.token_ids)
    assert response.usage.total_tokens == len(expected.prompt_token_ids) + len(expected.token_ids)


def test_greedy_chat_equals_llm_generate_on_the_chat_template(worker, client, reference):
    prompt_ids = chat_token_ids(reference, CHAT)
    expected = greedy(reference, prompt_ids, max_tokens=12)
    response = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0)
    assert response.object == "chat.completion"
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].message.content == expected.text
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (len(prompt_ids),
                                                                                 len(expected.token_ids))


def test_streamed_deltas_add_up_to_the_answer(worker, client):
    whole = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=20, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=20, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    with_choices = [c for c in chunks if c.choices]
    assert [c.choices[0].finish_reason for c in with_choices] == [None] * (len(with_choices) - 1) + ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert all(c.usage is None for c in chunks[:-1])

    completion = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0)
    pieces = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0, stream=True))
    assert all(p.object == "text_completion" for p in pieces) and pieces[-1].choices[0].finish_reason == "length"
    assert "".join(p.choices[0].text for p in pieces) == completion.choices[0].text


def test_server_sent_events_are_exactly_openai_s_format(worker, api):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{api.url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: {") for e in events[:-2])
    assert payloads[-1]["choices"] == [] and payloads[-1]["usage"]["completion_tokens"] == 5
    assert payloads[-2]["choices"][0]["finish_reason"] == "length"
    assert set(payloads[0]) == {"id", "object", "created", "model", "choices", "usage"}


def test_async_client_streams_and_answers_concurrently(worker, async_client):
    async def one(index: int) -> tuple[str, str]:
        prompt = f"{PROMPT} {index}"
        whole = await async_client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0)
        stream = await async_client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0,
                                                       stream=True)
        return whole.choices[0].text, "".join([chunk.choices[0].text async for chunk in stream])

    async def all_of_them():
        return await asyncio.gather(*(one(i) for i in range(4)))

    for whole, streamed in asyncio.run(all_of_them()):
        assert whole == streamed


def batch_answer(r, url: str, body: dict) -> dict:
    """The same body as a batch line, through the same worker: its response body."""
    line = json.dumps({"custom_id": "same", "method": "POST", "url": url, "body": body}).encode()
    submission = submit(r, lambda: [line], model=MODEL)
    assert submission.accepted, submission.report.errors
    batch_id = submission.batch_id
    deadline = time.monotonic() + 60
    while (line := r.hget(keys.batch_results(batch_id), "same")) is None:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return json.loads(line)["response"]["body"]


@pytest.mark.parametrize("fields", [
    {"n": 2, "temperature": 0.9, "seed": 11, "max_tokens": 8},
    {"temperature": 0, "max_tokens": 30, "stop": ["e", "an"]},
    {"temperature": 0, "max_tokens": 3},
    {"temperature": 0, "max_tokens": 6, "logprobs": 3},
], ids=["n=2", "stop", "max_tokens", "logprobs"])
def test_sampling_fields_behave_as_in_batch_lines(worker, client, r, fields):
    online = client.completions.create(model=MODEL, prompt=PROMPT, **fields).model_dump(exclude_unset=True)
    streamed = client.completions.create(model=MODEL, prompt=PROMPT, stream=True, **fields)
    texts: dict[int, str] = {}
    for chunk in streamed:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    batch = batch_answer(r, "/v1/completions", {"model": MODEL, "prompt": PROMPT, **fields})
    assert [c["text"] for c in online["choices"]] == [c["text"] for c in batch["choices"]]
    assert [texts[i] for i in range(len(batch["choices"]))] == [c["text"] for c in batch["choices"]]
    assert [c["finish_reason"] for c in online["choices"]] == [c["finish_reason"] for c in batch["choices"]]
    assert [c["logprobs"] for c in online["choices"]] == [c["logprobs"] for c in batch["choices"]]
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert [online["usage"][k] for k in counts] == [batch["usage"][k] for k in counts]


def test_chat_logprobs_match_batch_lines(worker, client, r):
    fields = {"temperature": 0, "max_tokens": 5, "logprobs": True, "top_logprobs": 2}
    online = client.chat.completions.create(model=MODEL, messages=CHAT, **fields).model_dump(exclude_unset=True)
    batch = batch_answer(r, "/v1/chat/completions", {"model": MODEL, "messages": CHAT, **fields})
    assert online["choices"][0]["logprobs"] == batch["choices"][0]["logprobs"]
    assert len(online["choices"][0]["logprobs"]["content"]) == 5


def test_a_disconnect_mid_stream_frees_the_blocks_within_a_second(worker, api):
    engine = worker.engine
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1000, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", f"{api.url}/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: {")
        assert engine.num_free_blocks < engine.num_total_blocks and worker.num_in_flight
    closed_at = time.monotonic()
    while worker.num_in_flight or engine.has_unfinished():
        assert time.monotonic() - closed_at < 1.0, "the request still runs a second after the disconnect"
        time.sleep(0.01)
    assert engine.num_free_blocks == engine.num_total_blocks


def test_unknown_model_is_404_model_not_found(worker, client):
    with pytest.raises(openai.NotFoundError) as raised:
        client.completions.create(model="no-such-model", prompt=PROMPT, max_tokens=2)
    assert raised.value.code == "model_not_found"
    assert raised.value.body["type"] == "invalid_request_error"


def test_a_request_the_model_cannot_hold_is_400_before_streaming(worker, client):
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5000, stream=True)
    assert raised.value.code == "context_length_exceeded"


def test_bad_fields_are_400_in_openai_shape(worker, client):
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0)
    assert raised.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model=MODEL, prompt=PROMPT, extra_body={"priority": "high"})
    assert raised.value.body["param"] == "priority"


def test_online_metrics_are_labelled_by_lane(worker, client, r):
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0)
    batch_answer(r, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "temperature": 0})
    registry = worker.metrics.registry
    for lane in ("online", "batch"):
        labels = {"worker": "online-worker", "model_name": MODEL, "lane": lane}
        assert registry.get_sample_value("kvfleet:generation_tokens_total", labels) == 3
        assert registry.get_sample_value("kvfleet:time_to_first_token_seconds_count", labels) == 1
        assert registry.get_sample_value("kvfleet:request_queue_time_seconds_count", labels) == 1


def ghost_worker(r, model: str) -> None:
    """A live heartbeat for `model` with nothing pulling its stream: requests only queue."""
    from jobs import heartbeats

    heartbeats.record_heartbeat(r, "ghost", {"models": [model], "root": model, "max_model_len": 64,
                                             "started_at": time.time()}, ttl_seconds=60)
    r.xgroup_create(keys.online_stream(model), keys.CONSUMER_GROUP, id="0", mkstream=True)


def test_a_full_online_queue_answers_429_with_retry_after(api, client, r, monkeypatch):
    from jobs import online

    monkeypatch.setenv("KVFLEET_MAX_ONLINE_QUEUE", "2")
    ghost_worker(r, "busy")
    for _ in range(2):  # two requests wait for a worker
        online.enqueue(r, "busy", online.OnlineEntry(online.new_request_id(), "/v1/completions", {"prompt": "x"},
                                                     False, 0, time.time() + 60, time.time()))
    with pytest.raises(openai.RateLimitError) as raised:
        client.completions.create(model="busy", prompt=PROMPT, max_tokens=2)
    assert raised.value.code == "too_many_requests" and raised.value.response.headers["retry-after"] == "1"
    assert r.xlen(keys.online_stream("busy")) == 2  # the refused one was not queued


def test_a_request_past_its_timeout_is_504_and_cancelled(api, client, r, monkeypatch):
    monkeypatch.setenv("KVFLEET_REQUEST_TIMEOUT", "1")
    ghost_worker(r, "slow")
    started = time.monotonic()
    with pytest.raises(openai.APIStatusError) as raised:
        client.completions.create(model="slow", prompt=PROMPT, max_tokens=2)
    assert raised.value.status_code == 504 and raised.value.code == "request_timeout"
    assert 1 <= time.monotonic() - started < 5
    [(_, [(_, fields)])] = r.xread({keys.online_stream("slow"): "0-0"})
    request_id = fields[b"request_id"].decode()
    assert r.exists(keys.reply_cancel(request_id))  # a worker that takes it later drops it


def test_online_requests_run_ahead_of_a_batch_backlog(worker, client, r):
    lines = [json.dumps({"custom_id": f"b{i}", "prompt": f"{PROMPT} {i}", "max_tokens": 24, "temperature": 0,
                         "ignore_eos": True}).encode() for i in range(64)]
    submission = submit(r, lambda: lines, model=MODEL)
    deadline = time.monotonic() + 30
    while not worker.num_in_flight:  # the worker is busy with the backlog
        assert time.monotonic() < deadline
        time.sleep(0.01)
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    assert response.choices[0].finish_reason == "length"
    done = batches.num_counted(r, submission.batch_id)
    assert done < 32, f"the online request waited for {done} of 64 batch requests"
    while batches.num_counted(r, submission.batch_id) < 64:  # and the backlog still completes
        assert time.monotonic() < deadline + 120
        time.sleep(0.1)


def test_a_stream_past_its_timeout_ends_with_an_error_event_and_stops_the_worker(worker, client, monkeypatch):
    monkeypatch.setenv("KVFLEET_REQUEST_TIMEOUT", "2")
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1000, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    received = 0
    with pytest.raises(openai.APIError) as raised:
        for _ in stream:
            received += 1
    assert received > 0 and "timed out" in raised.value.message
    deadline = time.monotonic() + 3
    while worker.num_in_flight or worker.engine.has_unfinished():
        assert time.monotonic() < deadline, "the worker still runs the request after its timeout"
        time.sleep(0.02)


INVOICE = {"type": "object", "properties": {"total": {"type": "integer", "minimum": 0, "maximum": 999},
                                            "paid": {"type": "boolean"}},
           "required": ["total", "paid"], "additionalProperties": False}


def test_response_format_json_schema_online_streamed_or_not(worker, client):
    response_format = {"type": "json_schema", "json_schema": {"name": "invoice", "schema": INVOICE}}
    whole = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=40, temperature=0,
                                           response_format=response_format)
    assert whole.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(whole.choices[0].message.content), INVOICE)
    chunks = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=40, temperature=0, stream=True,
                                            response_format=response_format)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    choice = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0,
                                       extra_body={"structured_outputs": {"choice": ["refund", "keep"]}})
    assert choice.choices[0].text in ("refund", "keep")


def test_a_bad_schema_online_is_a_400_naming_it(worker, client):
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=MODEL, messages=CHAT, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}})
    assert raised.value.body["param"] == "response_format.json_schema.schema"
    assert "not a valid JSON Schema" in raised.value.message
    with pytest.raises(openai.BadRequestError) as raised:  # EBNF is checked by the worker's compiler
        client.completions.create(model=MODEL, prompt=PROMPT, stream=True,
                                  extra_body={"structured_outputs": {"grammar": "root ::= ("}})
    assert raised.value.body["message"].startswith("structured_outputs.grammar: EBNF parser error")


def test_a_non_streaming_client_that_leaves_while_tokens_flow_is_cancelled(worker, api):
    engine = worker.engine
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1000, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up while the answer is being generated
        httpx.post(f"{api.url}/v1/completions", json=body, timeout=httpx.Timeout(60, read=1.5))
    left_at = time.monotonic()
    while worker.num_in_flight or engine.has_unfinished():
        assert time.monotonic() - left_at < 2.0, "the request still runs after its client left"
        time.sleep(0.01)
    assert engine.num_free_blocks == engine.num_total_blocks


def test_a_scaled_to_zero_model_waits_for_a_cold_start_instead_of_a_404(online_engine, redis_server, r, api, client,
                                                                         monkeypatch, reference):
    heartbeats.record_heartbeat(r, "gone", {"models": [MODEL], "root": MODEL, "max_model_len": 64}, 30)
    heartbeats.remove_worker(r, "gone")  # scaled to zero: no live worker, but the model is this fleet's
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="never-served", prompt=PROMPT, max_tokens=4)
    monkeypatch.setenv("KVFLEET_COLD_START_SECONDS", "1")
    started = time.monotonic()
    with pytest.raises(openai.APIStatusError) as raised:  # nothing woke up in time
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4)
    assert raised.value.status_code == 503 and raised.value.code == "model_cold_start_timeout"
    assert raised.value.response.headers["retry-after"] == "1" and time.monotonic() - started >= 1
    monkeypatch.setenv("KVFLEET_COLD_START_SECONDS", "60")
    answers = []
    waiting = threading.Thread(target=lambda: answers.append(client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0)))
    waiting.start()
    time.sleep(1.0)  # the request waits in the online stream: its lag is what wakes a worker (KEDA)
    assert online.online_backlog(r, MODEL) >= 1
    with WorkerThread(online_engine, redis_server.url):
        waiting.join(timeout=60)
    expected = reference.generate([PROMPT], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0]
    assert answers and answers[0].choices[0].text == expected.text
