"""Structured outputs through the batch path: `producers.submit` (a bad schema is a line
error and nothing is enqueued) and a worker, on the random-weight demo model."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from engine import EngineConfig, LLMEngine
from jobs import batches, keys
from jobs.storage import open_storage
from producers.submit import main as submit_cli
from tests.engine.test_structured_outputs import SCHEMAS
from tests.workers.helpers import MODEL, read_lines, run_until, submit_lines
from workers.worker import Worker, WorkerOptions


@pytest.fixture(scope="module")
def demo_engine(demo_model):
    return LLMEngine(EngineConfig(model=demo_model, num_kv_blocks=64, max_num_seqs=16))


def line(custom_id: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
            "body": {"prompt": f"Extract from document {custom_id}.", "temperature": 0, "max_tokens": 80, **body}}


def response_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "fields", "schema": schema, "strict": True}}


def test_a_batch_of_constrained_lines_through_a_worker(demo_engine, r):
    schemas = list(SCHEMAS.items())[:6]
    records = [line(f"{name}-{i}", response_format=response_format(schema)) for name, schema in schemas
               for i in range(4)]
    records += [line(f"code-{i}", structured_outputs={"regex": r"[A-Z]{3}-\d{4}"}) for i in range(4)]
    records += [line(f"pick-{i}", n=2, seed=i, temperature=0.9, structured_outputs={"choice": ["yes", "no"]})
                for i in range(4)]
    records += [line(f"free-{i}") for i in range(4)]  # unconstrained neighbours
    records += [line("ebnf", structured_outputs={"grammar": "root ::= ("})]  # checked by the worker's compiler
    batch_id = submit_lines(r, records)
    worker = Worker(demo_engine, r, WorkerOptions(name="w", served_model_names=[MODEL], block_ms=50,
                                                  maintain_seconds=0.05))
    done = run_until(worker, r, [batch_id], timeout=120)[batch_id]
    assert done["request_counts"] == {"total": 37, "completed": 36, "failed": 1}
    [error_line] = read_lines(r, done["error_file_id"])
    assert error_line["custom_id"] == "ebnf" and error_line["error"]["code"] == "invalid_request"
    assert error_line["error"]["message"].startswith("structured_outputs.grammar: ")
    bodies = {line["custom_id"]: line["response"]["body"] for line in read_lines(r, done["output_file_id"])}
    stopped = 0
    for name, schema in schemas:
        for i in range(4):
            choice = bodies[f"{name}-{i}"]["choices"][0]
            if choice["finish_reason"] == "stop":
                stopped += 1
                jsonschema.validate(json.loads(choice["text"]), schema)
    assert stopped >= 18
    assert all(re.fullmatch(r"[A-Z]{3}-\d{4}", bodies[f"code-{i}"]["choices"][0]["text"]) for i in range(4))
    assert all(c["text"] in ("yes", "no") for i in range(4) for c in bodies[f"pick-{i}"]["choices"])


@pytest.mark.parametrize(("schema", "message"), [
    ({"type": "nonsense"}, "body.response_format.json_schema.schema: not a valid JSON Schema"),
    ({"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}},
     "body.response_format.json_schema.schema: not supported by the grammar compiler: "
     "/properties/tags: uniqueItems: unique array items are not enforced"),
])
def test_a_bad_or_unsupported_schema_is_a_line_error_at_submit(tmp_path, redis_server, r, capsys, schema, message):
    path = tmp_path / "lines.jsonl"
    path.write_text(json.dumps(line("good", response_format=response_format(SCHEMAS["enum"]))) + "\n"
                    + json.dumps(line("bad", response_format=response_format(schema))) + "\n")
    assert submit_cli([str(path), "--redis-url", redis_server.url, "--model", MODEL]) == 1
    assert f"{path}:2: {message}" in capsys.readouterr().err
    assert r.keys("kvfleet:stream:*") == []  # nothing of that batch was enqueued

    assert submit_cli([str(path), "--redis-url", redis_server.url, "--model", MODEL, "--skip-invalid"]) == 0
    batch_id = capsys.readouterr().out.split()[0]
    assert [fields[b"custom_id"].decode() for _, fields in r.xrange(keys.batch_stream(MODEL, batch_id))] == ["good"]
    assert batches.batch_object(r, batch_id)["request_counts"] == {"total": 2, "completed": 0, "failed": 1}
    error = json.loads(open_storage("redis", r).get_result(batch_id, "bad"))["error"]
    assert error["code"] == "invalid_request" and message in error["message"]
