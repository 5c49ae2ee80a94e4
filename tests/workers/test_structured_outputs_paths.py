"""Structured outputs through the batch path: `producers.submit` (a bad schema is a line
error and nothing is enqueued) and a worker, on the random-weight demo model."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from engine import EngineConfig, LLMEngine
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
    batch_id = submit_lines(r, records)
    worker = Worker(demo_engine, r, WorkerOptions(name="w", served_model_names=[MODEL], block_ms=50,
                                                  maintain_seconds=0.05))
    done = run_until(worker, r, [batch_id], timeout=120)[batch_id]
    assert done["request_counts"] == {"total": 36, "completed": 36, "failed": 0}
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


def test_a_schema_that_is_not_a_schema_is_a_line_error_at_submit(tmp_path, redis_server, r, capsys):
    path = tmp_path / "lines.jsonl"
    bad = line("bad", response_format=response_format({"type": "nonsense"}))
    path.write_text(json.dumps(line("good", response_format=response_format(SCHEMAS["enum"]))) + "\n"
                    + json.dumps(bad) + "\n")
    assert submit_cli([str(path), "--redis-url", redis_server.url, "--model", MODEL]) == 1
    assert f"{path}:2: body.response_format.json_schema.schema: not a valid JSON Schema" in capsys.readouterr().err
    assert r.keys("kvfleet:stream:*") == []  # nothing of that batch was enqueued
