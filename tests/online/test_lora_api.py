"""LoRA adapters through the API with the official `openai` client: adapters named at start
(--lora-modules) listed by /v1/models under their base, answered online (streamed or not)
and in batch lines exactly as LLM.generate answers with that adapter; adapters named by a
folder or an s3:// URI under a --lora-resolver prefix, loaded on first use; and the errors
of an adapter that is not allowed, or broken."""

from __future__ import annotations

import json
import time
from pathlib import Path

import openai
import pytest

from engine import LLM, EngineConfig, LLMEngine, LoRARequest, SamplingParams
from jobs import batches
from producers.ingest import submit
from tests.lora_adapters import EIGHT, write_adapter
from tests.online.conftest import MODEL, WorkerThread
from tests.workers.helpers import read_lines, run_finalize_jobs
from workers.adapters import Adapters

PROMPT = "The fleet reads the queue and"


@pytest.fixture(scope="module")
def adapter_dirs(demo_model, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora")
    return {name: write_adapter(demo_model, root / "named" / name, EIGHT[index], seed=50 + index, scale=0.5)
            for index, name in [(3, "sql"), (7, "support"), (1, "dynamic")]}


@pytest.fixture(scope="module")
def lora_engine(demo_model) -> LLMEngine:
    return LLMEngine(EngineConfig(model=demo_model, num_kv_blocks=256, max_num_seqs=8, enable_lora=True,
                                  max_loras=2, max_lora_rank=64))


@pytest.fixture(scope="module")
def lora_reference(demo_model) -> LLM:
    return LLM(demo_model, num_kv_blocks=256, max_num_seqs=8, enable_lora=True, max_loras=2, max_lora_rank=64)


@pytest.fixture
def lora_worker(lora_engine, redis_server, r, api, adapter_dirs, s3_server):
    assert not lora_engine.has_unfinished()
    adapters = Adapters({"sql": str(adapter_dirs["sql"]), "support": str(adapter_dirs["support"])},
                        [str(adapter_dirs["dynamic"].parent) + "/", "s3://adapters-bucket/"])
    with WorkerThread(lora_engine, redis_server.url, adapters=adapters, name="lora-worker") as running:
        running._heartbeat()
        yield running


def expected(reference: LLM, folder: Path | None, name: str, prompt, max_tokens: int = 12):
    lora = None if folder is None else LoRARequest(name, 1, str(folder))
    return reference.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False,
                              lora_request=lora)[0]


def test_models_lists_each_adapter_under_its_base(lora_worker, client, adapter_dirs):
    models = {model.id: model for model in client.models.list().data}
    assert set(models) == {MODEL, "sql", "support"}
    assert models["sql"].parent == MODEL and models["sql"].root == str(adapter_dirs["sql"])
    assert models[MODEL].parent is None


def test_named_adapters_answer_as_llm_generate_does(lora_worker, client, lora_reference, adapter_dirs):
    for name in ("sql", "support"):
        want = expected(lora_reference, adapter_dirs[name], name, PROMPT)
        response = client.completions.create(model=name, prompt=PROMPT, max_tokens=12, temperature=0)
        assert response.model == name and response.choices[0].text == want.text
    base = expected(lora_reference, None, MODEL, PROMPT)
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0).choices[0].text \
        == base.text
    assert base.text != expected(lora_reference, adapter_dirs["sql"], "sql", PROMPT).text  # the adapter matters
    chunks = client.completions.create(model="support", prompt=PROMPT, max_tokens=12, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == \
        expected(lora_reference, adapter_dirs["support"], "support", PROMPT).text


def test_a_folder_under_a_resolver_prefix_loads_on_first_use(lora_worker, client, lora_reference, adapter_dirs):
    folder = str(adapter_dirs["dynamic"])
    response = client.completions.create(model=folder, prompt=PROMPT, max_tokens=12, temperature=0)
    assert response.choices[0].text == expected(lora_reference, adapter_dirs["dynamic"], folder, PROMPT).text
    deadline = time.monotonic() + 10  # served from now on: listed from the worker's next heartbeat
    while folder not in {model.id for model in client.models.list().data}:
        assert time.monotonic() < deadline, "the adapter named by its folder never joined the served models"
        time.sleep(0.05)


def test_an_s3_adapter_is_downloaded_once(lora_worker, client, lora_reference, adapter_dirs, s3_server):
    import boto3

    s3 = boto3.client("s3", endpoint_url=s3_server.url)
    s3.create_bucket(Bucket="adapters-bucket")
    for file in adapter_dirs["sql"].iterdir():
        s3.upload_file(str(file), "adapters-bucket", f"team-a/sql-v2/{file.name}")
    uri = "s3://adapters-bucket/team-a/sql-v2"
    want = expected(lora_reference, adapter_dirs["sql"], "sql", PROMPT).text
    for _ in range(2):
        assert client.completions.create(model=uri, prompt=PROMPT, max_tokens=12, temperature=0).choices[0].text == want
    folder = Path(lora_worker.streams.adapters.local[uri])
    assert sorted(path.name for path in folder.iterdir()) == [".complete", "adapter_config.json",
                                                              "adapter_model.safetensors"]  # what kvfleet reads
    with pytest.raises(openai.BadRequestError, match="no adapter_config.json under"):
        client.completions.create(model="s3://adapters-bucket/nothing-here", prompt=PROMPT, max_tokens=4)


def test_adapters_outside_the_resolver_or_broken_are_refused(lora_worker, client, tmp_path, adapter_dirs):
    with pytest.raises(openai.NotFoundError) as error:
        client.completions.create(model=str(tmp_path / "elsewhere"), prompt=PROMPT, max_tokens=4)
    assert error.value.body["code"] == "model_not_found"
    climbing = f"{adapter_dirs['dynamic'].parent}/../{adapter_dirs['dynamic'].parent.name}/dynamic"
    with pytest.raises(openai.NotFoundError):  # under the prefix by its text, not by its path
        client.completions.create(model=climbing, prompt=PROMPT, max_tokens=4)
    broken = adapter_dirs["dynamic"].parent / "broken"
    broken.mkdir(exist_ok=True)
    (broken / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8, "use_dora": True}))
    with pytest.raises(openai.BadRequestError, match="use_dora"):
        client.completions.create(model=str(broken), prompt=PROMPT, max_tokens=4)
    # The worker goes on: the next request for a good adapter answers.
    assert client.completions.create(model="sql", prompt=PROMPT, max_tokens=4).choices[0].text


def test_batch_lines_name_adapters(lora_worker, r, lora_reference, adapter_dirs):
    lines = [json.dumps({"custom_id": f"q{i}", "prompt": f"{PROMPT} {i}", "max_tokens": 8, "temperature": 0}).encode()
             for i in range(4)]
    submission = submit(r, lambda: lines, model="sql")
    assert submission.accepted
    deadline = time.monotonic() + 60
    while batches.batch_object(r, submission.batch_id)["status"] not in batches.TERMINAL:
        assert time.monotonic() < deadline, "the batch did not end"
        run_finalize_jobs(r)  # the finalizer's job, here in the test process
        time.sleep(0.1)
    done = batches.batch_object(r, submission.batch_id)
    assert done["status"] == "completed", done
    texts = {line["custom_id"]: (line["response"]["body"]["model"], line["response"]["body"]["choices"][0]["text"])
             for line in read_lines(r, done["output_file_id"])}
    assert texts == {f"q{i}": ("sql", expected(lora_reference, adapter_dirs["sql"], "sql", f"{PROMPT} {i}", 8).text)
                     for i in range(4)}


def test_an_adapter_named_by_path_is_its_tenants_own(lora_worker, api, r, monkeypatch, adapter_dirs):
    """The tenant whose request named the folder first owns it: for another it does not exist,
    not in requests, not in batches, not in /v1/models."""
    monkeypatch.setenv("KVFLEET_API_KEYS", "key-of-acme=acme,key-of-globex=globex")
    acme, globex = (openai.OpenAI(base_url=f"{api.url}/v1", api_key=key, max_retries=0, timeout=120)
                    for key in ("key-of-acme", "key-of-globex"))
    folder = str(adapter_dirs["dynamic"])
    assert acme.completions.create(model=folder, prompt=PROMPT, max_tokens=4, temperature=0).choices[0].text
    lora_worker._heartbeat()  # serving it now
    with pytest.raises(openai.NotFoundError) as refused:
        globex.completions.create(model=folder, prompt=PROMPT, max_tokens=4)
    assert refused.value.body["code"] == "model_not_found"
    assert folder in {m.id for m in acme.models.list().data}
    assert folder not in {m.id for m in globex.models.list().data}
    with pytest.raises(openai.NotFoundError):
        globex.models.retrieve(folder)
    line = json.dumps({"custom_id": "q", "method": "POST", "url": "/v1/completions",
                       "body": {"model": folder, "prompt": PROMPT, "max_tokens": 4}}) + "\n"
    upload = globex.files.create(file=("a.jsonl", line.encode()), purpose="batch")
    with pytest.raises(openai.NotFoundError):
        globex.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h")
    assert globex.batches.list().data == []  # nothing was created
    assert acme.completions.create(model="sql", prompt=PROMPT, max_tokens=4).choices[0].text  # named: everyone's
    assert globex.completions.create(model="sql", prompt=PROMPT, max_tokens=4).choices[0].text
