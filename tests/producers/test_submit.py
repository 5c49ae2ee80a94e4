"""`python -m producers.submit`: validate the whole file, then enqueue, idempotently."""

from __future__ import annotations

import json
import subprocess
import sys
import tracemalloc

import pytest

from jobs import batches, heartbeats, keys, queues
from jobs.entries import BATCH_ENTRY_FIELDS, BatchEntry
from jobs.storage import open_storage
from producers import ingest
from producers.submit import main


def write_lines(path, records) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


def chat(custom_id, text="Hi", **body):
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "demo", "messages": [{"role": "user", "content": text}], **body}}


def stream_entries(r, model="demo"):
    """The entries of every batch stream the model's registry lists (jobs/queues.py)."""
    return [{k.decode(): v.decode() for k, v in fields.items()}
            for queue in queues.registered(r, [model]) for _, fields in r.xrange(queue.stream)]


def run(redis_server, *args) -> int:
    return main(["--redis-url", redis_server.url, *args])


def test_valid_file_is_enqueued_and_batch_printed(r, redis_server, tmp_path, capsys):
    path = write_lines(tmp_path / "in.jsonl", [chat(f"c{i}", max_tokens=5) for i in range(5)])
    assert run(redis_server, path, "--metadata", "team=ops", "--json") == 0
    out = capsys.readouterr().out.splitlines()
    batch_id, batch = out[0], json.loads(out[-1])
    assert batch["id"] == batch_id and batch["status"] == "in_progress"
    assert batch["endpoint"] == "/v1/chat/completions" and batch["model"] == "demo"
    assert batch["request_counts"]["total"] == 5 and batch["metadata"] == {"team": "ops"}
    entries = stream_entries(r)
    assert [e["custom_id"] for e in entries] == [f"c{i}" for i in range(5)]
    assert entries[0]["batch_id"] == batch_id and entries[0]["line_number"] == "1"
    assert tuple(entries[0]) == BATCH_ENTRY_FIELDS  # what jobs/entries.py defines, in order
    assert json.loads(entries[0]["line"]) == chat("c0", max_tokens=5)
    entry = BatchEntry.from_fields(r.xrange(keys.batch_stream("demo", batch_id))[0][1])  # what the batch lane reads
    assert (entry.batch_id, entry.custom_id, entry.line_number, entry.requeues) == (batch_id, "c0", 1, 0)


def test_invalid_lines_are_reported_and_nothing_is_enqueued(r, redis_server, tmp_path, capsys):
    path = write_lines(tmp_path / "bad.jsonl", [
        chat("a"), chat("b", temperature=9), "{broken", chat("a"), {"prompt": "x"}, "", chat("e", model="other")])
    assert run(redis_server, path) == 1
    err = capsys.readouterr().err
    assert f"{path}:2: body.temperature: Input should be less than or equal to 2" in err
    assert f"{path}:3: line: not valid JSON" in err
    assert f"{path}:4: custom_id: duplicate custom_id 'a'" in err
    assert f"{path}:5: url: " not in err  # a short-form line may join a chat batch: it is a completion
    assert f"{path}:7: body.model: must match the batch model 'demo'" in err
    assert "4 of 6 lines invalid; nothing enqueued" in err
    assert r.keys("kvfleet:*") == []


def test_short_form_lines(r, redis_server, tmp_path, capsys):
    path = write_lines(tmp_path / "short.jsonl", [{"prompt": "one"}, {"custom_id": "two", "prompt": "2"},
                                                 {"prompt": "three", "max_tokens": 3}])
    assert run(redis_server, path, "--model", "demo") == 0
    assert [e["custom_id"] for e in stream_entries(r)] == ["line-1", "two", "line-3"]
    batch = batches.batch_object(r, capsys.readouterr().out.split()[0])
    assert batch["endpoint"] == "/v1/completions"


def test_skip_invalid_enqueues_the_rest_and_records_failures(r, redis_server, tmp_path, capsys):
    path = write_lines(tmp_path / "mixed.jsonl", [chat("a"), chat("b", top_p=2), chat("c"), "nope"])
    assert run(redis_server, path, "--skip-invalid") == 0
    batch_id = capsys.readouterr().out.split()[0]
    assert [e["custom_id"] for e in stream_entries(r)] == ["a", "c"]
    batch = batches.batch_object(r, batch_id)
    assert batch["request_counts"] == {"total": 4, "completed": 0, "failed": 2}
    storage = open_storage("redis", r)
    failed = json.loads(storage.get_result(batch_id, "b"))
    assert failed["error"]["code"] == "invalid_request"
    assert "line 2: body.top_p" in failed["error"]["message"]
    assert json.loads(storage.get_result(batch_id, "line-4"))["error"]["message"].startswith("line 4: line:")


def test_resubmitting_with_the_same_batch_id_enqueues_nothing_twice(r, redis_server, tmp_path, capsys):
    path = write_lines(tmp_path / "in.jsonl", [chat(f"c{i}") for i in range(7)])
    assert run(redis_server, path, "--batch-id", "batch_fixed") == 0
    assert run(redis_server, path, "--batch-id", "batch_fixed") == 0
    assert len(stream_entries(r)) == 7
    assert batches.batch_object(r, "batch_fixed")["request_counts"]["total"] == 7


def test_a_crashed_submit_resumes_without_duplicates(r, redis_server, tmp_path, monkeypatch):
    path = write_lines(tmp_path / "in.jsonl", [chat(f"c{i}") for i in range(10)])
    monkeypatch.setattr(ingest, "CHUNK_LINES", 3)  # a round trip each 3 lines
    monkeypatch.setattr(keys, "PARTITION_LINES", 3)  # and one script each 3 lines
    calls = []

    def crash_after_two_chunks(count):
        calls.append(count)
        if len(calls) == 2:
            raise KeyboardInterrupt

    def source():
        with open(path, "rb") as handle:
            yield from handle

    with pytest.raises(KeyboardInterrupt):
        ingest.submit(r, source, batch_id="batch_crash", on_progress=crash_after_two_chunks)
    assert len(stream_entries(r)) == 6
    again = ingest.submit(r, source, batch_id="batch_crash")
    assert again.num_enqueued == 4
    assert [e["custom_id"] for e in stream_entries(r)] == [f"c{i}" for i in range(10)]


def test_missing_file_and_bad_output(redis_server, tmp_path, capsys):
    assert run(redis_server, str(tmp_path / "nope.jsonl")) == 2
    path = write_lines(tmp_path / "in.jsonl", [chat("a")])
    assert run(redis_server, path, "--output", "ftp://x") == 2
    assert "output: expected 'redis', 's3://bucket/prefix' or 'file:///absolute/dir'" in capsys.readouterr().err


def test_hundred_thousand_lines_in_bounded_memory(r, tmp_path):
    path = tmp_path / "big.jsonl"
    with open(path, "w") as handle:
        for i in range(100_000):
            handle.write(json.dumps({"custom_id": f"doc-{i:06d}", "prompt": f"Summarize document {i}.",
                                     "max_tokens": 16}) + "\n")
    file_size = path.stat().st_size

    def source():
        with open(path, "rb") as f:
            yield from f

    tracemalloc.start()
    submission = ingest.submit(r, source, model="demo")
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert submission.num_enqueued == 100_000
    assert r.xlen(keys.batch_stream("demo", submission.batch_id)) == 100_000
    # The duplicate check keeps 8-byte digests (plus a sorted copy); lines are never all held.
    assert peak < 24 * 100_000 + 1_000_000, f"peak {peak} bytes for a {file_size}-byte file"


def test_cli_entry_point(redis_server, r, tmp_path):
    path = write_lines(tmp_path / "in.jsonl", [{"prompt": "hello"}])
    done = subprocess.run([sys.executable, "-m", "producers.submit", path, "--redis-url", redis_server.url,
                           "--model", "demo"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().startswith("batch_")
    assert "torch" not in subprocess.run([sys.executable, "-c", "import sys, producers.submit, producers.api; "
                                          "print(sorted(m for m in sys.modules if m.startswith('torch')))"],
                                         capture_output=True, text=True, timeout=60).stdout.replace("[]", "")


def test_status_prints_the_batch(r, redis_server, tmp_path, capsys):
    from producers.status import main as status_main

    path = write_lines(tmp_path / "in.jsonl", [chat("a"), chat("b")])
    assert run(redis_server, path) == 0
    batch_id = capsys.readouterr().out.split()[0]
    assert status_main([batch_id, "--redis-url", redis_server.url]) == 0
    out = capsys.readouterr().out
    # No result and no worker yet: no ETA, against its 24-hour deadline.
    assert out.splitlines()[0] in (f"{batch_id}  in_progress  0 completed, 0 failed of 2  ETA —, deadline {d}"
                                   for d in ("24.0h", "1.0d"))
    batch = json.loads(out.split("\n", 1)[1])
    assert batch["id"] == batch_id and batch["eta_at"] is None and batch["at_risk"] is False
    assert status_main(["batch_missing", "--redis-url", redis_server.url]) == 1


def beat(r, name: str, models: list[str], ttl: int = 30) -> None:
    """A worker's heartbeat, written through the same contract function workers use."""
    heartbeats.record_heartbeat(r, name, {"models": models, "root": f"/models/{models[0]}", "max_model_len": 2048},
                                ttl)


def test_a_model_no_live_worker_serves_warns_and_still_enqueues(r, redis_server, tmp_path, capsys):
    beat(r, "w1", ["llama-8b", "llama"])
    beat(r, "w2", ["qwen"])
    beat(r, "gone", ["demo"], ttl=1)
    r.delete(keys.worker("gone"))  # its heartbeat expired: a dead worker serves nothing
    path = write_lines(tmp_path / "in.jsonl", [chat("c0")])
    assert run(redis_server, path) == 0
    err = capsys.readouterr().err
    assert "warning: no live worker serves model 'demo'; live workers serve: 'llama', 'llama-8b', 'qwen'" in err
    assert len(stream_entries(r)) == 1


def test_require_worker_makes_it_an_error_and_enqueues_nothing(r, redis_server, tmp_path, capsys):
    path = write_lines(tmp_path / "in.jsonl", [chat("c0"), chat("c1")])
    assert run(redis_server, path, "--require-worker") == 2
    err = capsys.readouterr().err
    assert "error: no live worker serves model 'demo'; live workers serve: none; nothing enqueued" in err
    assert stream_entries(r) == [] and r.zcard(keys.BATCHES) == 0
    beat(r, "w1", ["demo"])
    assert run(redis_server, path, "--require-worker") == 0
    assert "warning" not in capsys.readouterr().err and len(stream_entries(r)) == 2


def test_results_go_only_where_the_operator_allows(r, redis_server, tmp_path, capsys, monkeypatch):
    path = write_lines(tmp_path / "in.jsonl", [chat("a")])
    monkeypatch.delenv("KVFLEET_ALLOWED_OUTPUTS", raising=False)
    monkeypatch.delenv("KVFLEET_DEFAULT_OUTPUT", raising=False)
    assert run(redis_server, path, "--output", f"file://{tmp_path}/out") == 1  # default: only the default output
    assert f"output: 'file://{tmp_path}/out' is not an allowed destination; the operator allows redis " \
           "(KVFLEET_ALLOWED_OUTPUTS)" in capsys.readouterr().err
    assert not r.keys("kvfleet:batch:*")  # nothing was created
    monkeypatch.setenv("KVFLEET_ALLOWED_OUTPUTS", f"redis, file://{tmp_path}/allowed/")
    assert run(redis_server, path, "--output", f"file://{tmp_path}/allowed-not") == 1
    assert run(redis_server, path, "--output", f"file://{tmp_path}/allowed/../escape") == 2  # never a '..'
    assert "a path with '..' is not accepted" in capsys.readouterr().err
    assert run(redis_server, path, "--output", f"file://{tmp_path}/allowed/team-a") == 0
    batch_id = capsys.readouterr().out.splitlines()[0]
    assert batches.load_fields(r, batch_id)["sink"] == f"file://{tmp_path}/allowed/team-a"


@pytest.mark.parametrize("batch_id", ["../../x", "a/b", "has space", "x" * 129, "", "dot.ted"])
def test_a_batch_id_outside_the_pattern_is_refused_before_anything_is_written(r, redis_server, tmp_path, capsys,
                                                                             batch_id):
    path = write_lines(tmp_path / "in.jsonl", [chat("a")])
    with pytest.raises(SystemExit) as exited:
        run(redis_server, path, "--batch-id", batch_id)
    assert exited.value.code == 2
    assert "batch_id: must be 1 to 128 letters, digits, '_' or '-'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="batch_id: must be"):
        ingest.submit(r, lambda: [json.dumps(chat("a")).encode()], batch_id=batch_id)
    with pytest.raises(ValueError, match="batch_id: must be"):
        batches.create_batch(r, batch_id, endpoint="/v1/completions", model="m", input_file_id=None,
                             completion_window="24h", sink="redis")
    assert not r.keys("kvfleet:*")


def test_a_schema_nested_too_deep_is_a_named_line_error(r, redis_server, tmp_path, capsys):
    schema = {"type": "object"}
    for _ in range(150):
        schema = {"type": "object", "properties": {"a": schema}}
    deep = chat("a", response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}})
    path = write_lines(tmp_path / "in.jsonl", [deep, "[" * 50_000 + "]" * 50_000])
    assert run(redis_server, path) == 1
    err = capsys.readouterr().err
    assert f"{path}:1: body.response_format.json_schema.schema: the schema nests deeper than 64 levels" in err
    assert f"{path}:2: line: nests too deeply to parse" in err


def test_tenant_files_the_batch_as_that_tenants(r, redis_server, tmp_path, capsys):
    path = write_lines(tmp_path / "in.jsonl", [chat("c0")])
    assert run(redis_server, path, "--tenant", "acme", "--json") == 0
    batch_id = capsys.readouterr().out.splitlines()[0]
    assert batches.load_fields(r, batch_id)["tenant"] == "acme"
    assert r.zscore(keys.tenant_batches("acme"), batch_id) is not None  # listed for acme, and no one else
    with pytest.raises(SystemExit) as refused:
        run(redis_server, path, "--tenant", "no spaces")
    assert refused.value.code == 2 and "--tenant: must be 1-64 letters" in capsys.readouterr().err
