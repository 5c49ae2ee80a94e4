"""The scripts in examples/ do what their docs say, each checked on the fleet its guide starts
(tests/docs/test_documented_commands.py runs them there): labels equal the online answers,
extractions validate against their schema, search ranks as sentence-transformers does, and a
stream prints the greedy answer."""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import subprocess
import sys

import jsonschema
import numpy as np
import openai
from sentence_transformers import SentenceTransformer

from engine.checkpoint import embedding_demo_path
from tests.docs.fleets import ROOT, Fleet

DEMO_FLEET = "python -m workers.serve --model demo --port 8000"
EMBEDDING_FLEET = "python -m workers.serve --model demo-embedding --port 8001"
DOCUMENTS = ROOT / "examples" / "documents"


def run_example(fleet: Fleet, script: str, *args: str) -> str:
    env = {**os.environ, "OPENAI_BASE_URL": f"http://127.0.0.1:{fleet.port}/v1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(ROOT / "examples" / script), *args], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def client_of(fleet: Fleet) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{fleet.port}/v1", api_key="unused", max_retries=0)


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def classify_folder_labels_every_file_as_the_same_request_online(fleet: Fleet, tmp_path) -> None:
    labels = ["invoice", "contract", "support", "other"]
    run_example(fleet, "classify_folder.py", str(DOCUMENTS), "--labels", ",".join(labels), "--out",
                str(tmp_path / "labels.csv"))
    rows = list(csv.DictReader((tmp_path / "labels.csv").open()))
    files = sorted(path.name for path in DOCUMENTS.glob("*.txt"))
    assert [row["file"] for row in rows] == files
    jsonl, names = load_example("classify_folder").batch_lines(DOCUMENTS, labels, "demo")
    for line in jsonl.splitlines():  # the batch's answers are the online path's, token for token
        request = json.loads(line)
        constraint = {"structured_outputs": request["body"].pop("structured_outputs")}
        online = client_of(fleet).chat.completions.create(**request["body"], extra_body=constraint)
        row = next(row for row in rows if row["file"] == names[request["custom_id"]])
        assert (row["label"], row["error"]) == (online.choices[0].message.content, "")
        assert row["label"] in labels


def extract_json_answers_validate_against_the_schema(fleet: Fleet, tmp_path) -> None:
    schema_path = ROOT / "examples" / "invoice_schema.json"
    invoices = sorted(DOCUMENTS.glob("invoice-*.txt"))
    lines = [json.loads(line) for line in run_example(fleet, "extract_json.py",
                                                      *map(str, invoices), "--schema", str(schema_path)).splitlines()]
    assert [line["file"] for line in lines] == [path.name for path in invoices]
    for line in lines:
        jsonschema.validate(line["fields"], json.loads(schema_path.read_text()))


def embed_search_ranks_the_folder_as_sentence_transformers_does(fleet: Fleet, tmp_path) -> None:
    query = "When must the invoice be paid?"
    printed = run_example(fleet, "embed_search.py", str(DOCUMENTS), query, "--top", "20")
    found = [(float(line.split()[0]), line.split()[1].rstrip(":")) for line in printed.splitlines()]
    chunks = load_example("embed_search").chunks(DOCUMENTS)
    model = SentenceTransformer(str(embedding_demo_path()), device="cpu")
    vectors = model.encode([text for _, text in chunks], normalize_embeddings=True)
    scores = vectors @ model.encode(query, normalize_embeddings=True)
    order = np.argsort(-scores)
    assert len(found) == len(chunks) >= len(list(DOCUMENTS.glob("*.txt")))
    assert [name for _, name in found] == [chunks[index][0] for index in order]
    assert np.allclose([score for score, _ in found], scores[order], atol=1.5e-3)  # printed to 3 decimals


def stream_chat_prints_the_greedy_answer_and_the_demo_knows_paris(fleet: Fleet, tmp_path) -> None:
    assert "engine: LlamaForCausalLM, 135M parameters" in fleet.log.read_text()  # serve shows what was chosen
    question = [{"role": "user", "content": "What is the capital of France?"}]
    whole = client_of(fleet).chat.completions.create(model="demo", messages=question, max_tokens=32, temperature=0)
    assert whole.choices[0].message.content == "The capital of France is Paris."  # the README's demo answer
    printed = run_example(fleet, "stream_chat.py", question[0]["content"], "--max-tokens", "32", "--temperature", "0")
    answer, usage = printed.rsplit("\n[", 1)
    assert answer == whole.choices[0].message.content
    assert usage == f"{whole.usage.prompt_tokens} prompt tokens, {whole.usage.completion_tokens} generated]\n"


CHECKS = {DEMO_FLEET: [classify_folder_labels_every_file_as_the_same_request_online,
                       extract_json_answers_validate_against_the_schema,
                       stream_chat_prints_the_greedy_answer_and_the_demo_knows_paris],
          EMBEDDING_FLEET: [embed_search_ranks_the_folder_as_sentence_transformers_does]}
