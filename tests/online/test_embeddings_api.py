"""/v1/embeddings through the fleet, with the official `openai` client: online (list inputs,
token ids, base64 and floats, limits as 400s) and as a 2,000-line batch through
producers.submit, a worker and the Batches API, whose output equals the online answers."""

from __future__ import annotations

import base64
import json
import time

import numpy as np
import openai
import pytest

from engine import EmbeddingEngine, EngineConfig, PoolingParams, create_engine
from producers import submit as submit_cli
from tests.embedding_models import texts
from tests.online.conftest import WorkerThread
from tests.services import run_finalize_jobs

MODEL = "minilm"


@pytest.fixture(scope="module")
def embedding_engine() -> EmbeddingEngine:
    return create_engine(EngineConfig(model="demo-embedding"))


@pytest.fixture
def embed_worker(embedding_engine, redis_server, api):
    with WorkerThread(embedding_engine, redis_server.url, name="embed-worker", served_model_names=[MODEL]) as running:
        running._heartbeat()
        yield running
    assert not embedding_engine.has_unfinished()


def offline(engine: EmbeddingEngine, inputs, **params) -> np.ndarray:
    engine.add_request("offline", inputs, PoolingParams(**params))
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    return np.array([o.embedding for o in outputs[0].outputs])


def from_base64(embedding: str) -> np.ndarray:
    """An `encoding_format: "base64"` embedding: little-endian float32, as OpenAI sends it."""
    return np.frombuffer(base64.b64decode(embedding), dtype="<f4")


def test_openai_client_embeddings_with_list_inputs(embed_worker, client, embedding_engine):
    inputs = texts(20, seed=1, longest_words=150)
    response = client.embeddings.create(model=MODEL, input=inputs)  # the client asks for base64 and decodes it
    assert response.object == "list" and response.model == MODEL
    assert [d.index for d in response.data] == list(range(20)) and all(d.object == "embedding" for d in response.data)
    got = np.array([d.embedding for d in response.data])
    expected = offline(embedding_engine, inputs)
    assert got.shape == (20, 384)
    assert np.allclose(got, expected, atol=1e-6)
    num_tokens = sum(len(embedding_engine.tokenizer(t)["input_ids"]) for t in inputs)  # [CLS] and [SEP] counted
    assert response.usage.prompt_tokens == response.usage.total_tokens == num_tokens


def test_floats_base64_and_token_ids(embed_worker, client, api, embedding_engine):
    import httpx  # noqa: PLC0415

    floats = client.embeddings.create(model=MODEL, input="a fleet of workers", encoding_format="float")
    raw = httpx.post(f"{api.url}/v1/embeddings", json={"model": MODEL, "input": "a fleet of workers",
                                                        "encoding_format": "base64"}).json()
    decoded = from_base64(raw["data"][0]["embedding"])
    assert decoded.tolist() == floats.data[0].embedding  # float32 both ways: bit for bit
    ids = embedding_engine.tokenizer("a fleet of workers")["input_ids"]
    by_ids = client.embeddings.create(model=MODEL, input=ids, encoding_format="float")
    assert np.allclose(by_ids.data[0].embedding, floats.data[0].embedding, atol=1e-6)
    assert by_ids.usage.prompt_tokens == len(ids)  # used as given: nothing added
    two = client.embeddings.create(model=MODEL, input=[ids, ids[1:-1]], encoding_format="float")
    assert two.usage.prompt_tokens == 2 * len(ids) - 2


def test_limits_and_bad_requests_are_400s(embed_worker, client):
    long_text = "word " * 300
    with pytest.raises(openai.BadRequestError, match="exceed this model's limit of 256 tokens") as error:
        client.embeddings.create(model=MODEL, input=["ok", long_text])
    assert error.value.code == "context_length_exceeded"
    truncated = client.embeddings.create(model=MODEL, input=long_text, extra_body={"truncate_prompt_tokens": 128})
    assert truncated.usage.prompt_tokens == 128
    with pytest.raises(openai.BadRequestError, match="does not support Matryoshka"):
        client.embeddings.create(model=MODEL, input="x", dimensions=64)
    with pytest.raises(openai.BadRequestError, match="must be a non-empty string, a list of non-empty strings"):
        client.embeddings.create(model=MODEL, input=[])
    with pytest.raises(openai.BadRequestError, match="it serves /v1/embeddings, not /v1/completions"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="no-such-model", input="x")


def test_models_say_what_each_model_does(embed_worker, client):
    (model,) = [m for m in client.models.list().data if m.id == MODEL]
    assert model.task == "embed" and model.max_model_len == 256


def test_a_2000_line_batch_equals_the_online_answers(embed_worker, client, redis_server, r, tmp_path, capsys):
    inputs = texts(2000, seed=9, longest_words=40)
    path = tmp_path / "embeddings.jsonl"
    path.write_text("".join(json.dumps({"custom_id": f"doc-{i}", "method": "POST", "url": "/v1/embeddings",
                                        "body": {"model": MODEL, "input": text}}) + "\n"
                            for i, text in enumerate(inputs)))
    assert submit_cli.main([str(path), "--redis-url", redis_server.url, "--json"]) == 0
    batch_id = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["id"]
    deadline = time.monotonic() + 300
    while (batch := client.batches.retrieve(batch_id)).status != "completed":  # the finalize job, as RQ runs it
        assert time.monotonic() < deadline and batch.status in ("in_progress", "finalizing"), batch.status
        run_finalize_jobs(r)
        time.sleep(0.2)
    assert batch.status == "completed" and batch.endpoint == "/v1/embeddings"
    assert (batch.request_counts.completed, batch.request_counts.failed) == (2000, 0)
    lines = {(line := json.loads(raw))["custom_id"]: line for raw in
             client.files.content(batch.output_file_id).text.splitlines()}
    assert len(lines) == 2000
    online = []
    for start in range(0, 2000, 250):
        response = client.embeddings.create(model=MODEL, input=inputs[start:start + 250])
        online += [d.embedding for d in response.data]
    batch_vectors = np.array([lines[f"doc-{i}"]["response"]["body"]["data"][0]["embedding"] for i in range(2000)])
    assert np.allclose(batch_vectors, np.array(online), atol=1e-6)
    body = lines["doc-0"]["response"]["body"]
    assert body["object"] == "list" and body["model"] == MODEL and body["data"][0]["object"] == "embedding"
    assert batch.usage.input_tokens == sum(line["response"]["body"]["usage"]["prompt_tokens"]
                                           for line in lines.values())


def test_200_texts_with_dimensions_and_base64_match_sentence_transformers(tmp_path, redis_server, api):
    """all-MiniLM declared Matryoshka: 200 texts from 1 word to past the limit (truncated),
    `dimensions` 128 as base64, through the queue, against sentence-transformers truncated
    and normalized again."""
    import httpx  # noqa: PLC0415
    import torch  # noqa: PLC0415
    import torch.nn.functional as F  # noqa: PLC0415
    from sentence_transformers import SentenceTransformer  # noqa: PLC0415

    from tests.embedding_models import matryoshka_minilm, minilm_folder  # noqa: PLC0415

    engine = create_engine(EngineConfig(model=str(matryoshka_minilm(tmp_path / "m"))))
    batch = texts(200)
    with WorkerThread(engine, redis_server.url, name="matryoshka-worker", served_model_names=["m"]) as running:
        running._heartbeat()
        answer = httpx.post(f"{api.url}/v1/embeddings", timeout=120, json={
            "model": "m", "input": batch, "dimensions": 128, "encoding_format": "base64",
            "truncate_prompt_tokens": -1}).json()
    got = torch.tensor(np.stack([from_base64(d["embedding"]) for d in answer["data"]]))
    full = SentenceTransformer(str(minilm_folder()), device="cpu").encode(batch, convert_to_tensor=True)
    assert got.shape == (200, 128)
    assert F.cosine_similarity(got, F.normalize(full[:, :128], dim=1)).min() >= 0.9999
