"""`python -m workers.run_batch`: a JSONL file through one engine, no Redis. One OpenAI
batch output line per input line, written as each request finishes; malformed lines
named before anything runs; an interrupted run keeps what it finished."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from openai.types.responses import Response

from engine import LLM, EngineConfig, LLMEngine, SamplingParams, create_engine
from tests.chat_models import ScriptedSampler, write_thinking_model
from workers.run_batch import Runner, main

ROOT = Path(__file__).resolve().parents[2]


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in records) + "\n")
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_one_openai_result_line_per_input_line(tiny_llama, tmp_path):
    source = write_jsonl(tmp_path / "in.jsonl", [
        {"custom_id": "a", "prompt": "hello world", "max_tokens": 5, "temperature": 0},
        {"custom_id": "too-long", "prompt": "hi", "max_tokens": 100000},
        "",
        {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "named", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}},
        {"prompt": "the cat", "max_tokens": 3},
    ])
    out = tmp_path / "out.jsonl"
    assert main([str(source), "-o", str(out), "--model", tiny_llama, "--num-kv-blocks", "64"]) == 0
    lines = {line["custom_id"]: line for line in read_jsonl(out)}
    assert sorted(lines) == ["a", "chat", "line-5", "too-long"]
    assert lines["too-long"]["response"] is None
    assert lines["too-long"]["error"]["code"] == "context_length_exceeded"
    assert "max_tokens 100000" in lines["too-long"]["error"]["message"]
    body = lines["a"]["response"]["body"]
    assert lines["a"]["error"] is None and lines["a"]["response"]["status_code"] == 200
    assert body["object"] == "text_completion" and body["model"] == tiny_llama  # --model exactly as given
    expected = LLM(tiny_llama, num_kv_blocks=64).generate(["hello world"], SamplingParams(temperature=0, max_tokens=5),
                                                          use_tqdm=False)[0]
    assert body["choices"][0]["text"] == expected.text
    assert body["usage"]["completion_tokens"] == 5 and body["usage"]["prompt_tokens"] == len(expected.prompt_token_ids)
    chat = lines["chat"]["response"]["body"]
    assert chat["object"] == "chat.completion" and chat["model"] == "named"
    assert chat["usage"]["completion_tokens"] == 4 and chat["choices"][0]["message"]["role"] == "assistant"
    assert lines["line-5"]["response"]["body"]["usage"]["completion_tokens"] == 3


def test_the_example_chat_batch_runs_and_vllms_input_flag_works(tiny_llama, tmp_path, capsys):
    assert main(["-i", str(ROOT / "examples" / "chat_batch.jsonl"), "-o", "-", "--model", tiny_llama,
                 "--served-model-name", "demo", "--num-kv-blocks", "64"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    inputs = [json.loads(line) for line in (ROOT / "examples" / "chat_batch.jsonl").read_text().splitlines()]
    assert sorted(line["custom_id"] for line in lines) == sorted(i["custom_id"] for i in inputs)
    assert all(line["response"]["status_code"] == 200 for line in lines)
    assert all(line["response"]["body"]["object"] == "chat.completion" for line in lines)


def test_malformed_lines_are_named_and_nothing_runs(tiny_llama, tmp_path, capsys):
    source = write_jsonl(tmp_path / "bad.jsonl", [
        {"prompt": "fine"},
        "{not json",
        {"custom_id": "x"},
        {"prompt": "p", "max_tokens": 0},
        ["a list"],
        {"custom_id": "d", "prompt": "p"},
        {"custom_id": "d", "prompt": "q"},
    ])
    out = tmp_path / "out.jsonl"
    assert main([str(source), "-o", str(out), "--model", tiny_llama]) == 1
    err = capsys.readouterr().err
    assert f"{source}:2: line: not valid JSON" in err
    assert f"{source}:3: prompt:" in err
    assert f"{source}:4: max_tokens:" in err
    assert f"{source}:5: line: must be a JSON object" in err
    assert f"{source}:7: custom_id: duplicate custom_id 'd'" in err
    assert ":1:" not in err and ":6:" not in err
    assert not out.exists()


def test_skip_invalid_writes_error_lines_and_runs_the_rest(tiny_llama, tmp_path):
    source = write_jsonl(tmp_path / "mixed.jsonl", [
        {"custom_id": "ok", "prompt": "fine", "max_tokens": 2},
        {"custom_id": "bad", "prompt": "p", "max_tokens": 0},
        "{not json",
    ])
    out = tmp_path / "out.jsonl"
    assert main([str(source), "-o", str(out), "--model", tiny_llama, "--skip-invalid"]) == 0
    lines = {line["custom_id"]: line for line in read_jsonl(out)}
    assert sorted(lines) == ["bad", "line-3", "ok"]
    assert lines["bad"]["error"]["code"] == "invalid_request" and "max_tokens" in lines["bad"]["error"]["message"]
    assert lines["line-3"]["error"]["message"].startswith("line 3: line: not valid JSON")
    assert lines["ok"]["response"]["body"]["usage"]["completion_tokens"] == 2


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the dropped raise, on purpose
def test_a_sigterm_swallowed_by_a_finalizer_still_stops_the_run(tiny_llama, tmp_path):
    """The handler's KeyboardInterrupt can land inside a __del__, where Python drops it: the next step raises it."""
    engine = LLMEngine(EngineConfig(model=tiny_llama, num_kv_blocks=32))
    with open(tmp_path / "out.jsonl", "w", encoding="utf-8") as out:
        runner = Runner(engine, "tiny", out)
        runner.add(1, json.dumps({"custom_id": "a", "prompt": "one", "max_tokens": 50, "ignore_eos": True}).encode())
        saved = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
        try:
            runner.stop_on_signals()
            runner.step()

            class Finalized:
                def __del__(self):
                    signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)

            Finalized()  # collected at once: its KeyboardInterrupt is printed and dropped
            with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
                runner.step()
        finally:
            for signum, handler in saved.items():
                signal.signal(signum, handler)
            engine.shutdown()
    assert runner.num_written == 0 and len(runner.pending) == 1


def test_sigint_keeps_the_finished_lines_and_resume_completes_the_rest(tiny_llama, tmp_path):
    num_requests = 24
    source = write_jsonl(tmp_path / "long.jsonl", [
        {"custom_id": f"r{i}", "prompt": f"request {i}", "max_tokens": 150, "ignore_eos": True}
        for i in range(num_requests)])
    out = tmp_path / "out.jsonl"
    command = [sys.executable, "-m", "workers.run_batch", str(source), "-o", str(out), "--model", tiny_llama,
               "--max-num-seqs", "2", "--num-kv-blocks", "64"]
    process = subprocess.Popen(command, cwd=ROOT, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + 120
    while (not out.exists() or len(out.read_text().splitlines()) < 2) and time.monotonic() < deadline:
        assert process.poll() is None, process.stderr.read()
        time.sleep(0.05)
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 130, err
    kept = read_jsonl(out)  # every line is whole JSON
    assert 2 <= len(kept) < num_requests, len(kept)
    assert all(line["response"]["body"]["usage"]["completion_tokens"] == 150 for line in kept)
    assert f"interrupted: {len(kept)} results written" in err

    resumed = subprocess.run([*command, "--resume"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    custom_ids = [line["custom_id"] for line in read_jsonl(out)]
    assert sorted(custom_ids) == sorted(f"r{i}" for i in range(num_requests))  # each once


def test_embeddings_lines_on_an_embedding_model(tmp_path):
    """An embedding model runs /v1/embeddings lines (several inputs a line, base64 too) into
    OpenAI's embeddings bodies; a completion line gets its own error line."""
    import base64  # noqa: PLC0415

    import numpy as np  # noqa: PLC0415

    from engine import EngineConfig, PoolingParams, create_engine  # noqa: PLC0415

    source = write_jsonl(tmp_path / "in.jsonl", [
        {"custom_id": "one", "method": "POST", "url": "/v1/embeddings", "body": {"input": "a fleet of workers"}},
        {"custom_id": "two", "method": "POST", "url": "/v1/embeddings",
         "body": {"model": "minilm", "input": ["first", "second text"], "encoding_format": "base64"}},
        {"custom_id": "long", "method": "POST", "url": "/v1/embeddings", "body": {"input": "word " * 300}},
        {"custom_id": "completion", "prompt": "hello", "max_tokens": 2},
    ])
    out = tmp_path / "out.jsonl"
    assert main([str(source), "-o", str(out), "--model", "demo-embedding"]) == 0
    lines = {line["custom_id"]: line for line in read_jsonl(out)}
    engine = create_engine(EngineConfig(model="demo-embedding"))
    engine.add_request("x", ["a fleet of workers", "first", "second text"], PoolingParams())
    (expected,) = engine.step()
    one = lines["one"]["response"]["body"]
    assert one["object"] == "list" and one["model"] == "demo-embedding" and one["usage"]["prompt_tokens"] == 6
    assert np.allclose(one["data"][0]["embedding"], expected.outputs[0].embedding, atol=1e-6)
    two = lines["two"]["response"]["body"]
    assert two["model"] == "minilm" and [d["index"] for d in two["data"]] == [0, 1]
    decoded = [np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in two["data"]]
    assert all(np.allclose(v, e.embedding, atol=1e-6) for v, e in zip(decoded, expected.outputs[1:]))
    assert lines["long"]["error"]["code"] == "context_length_exceeded"
    assert lines["completion"]["error"]["code"] == "invalid_request"
    assert "this model is an embedding model" in lines["completion"]["error"]["message"]


def test_lines_name_lora_adapters_by_their_model(tiny_llama, tmp_path):
    from engine import LoRARequest
    from tests.lora_adapters import EIGHT, write_adapter

    folder = write_adapter(tiny_llama, tmp_path / "sql", EIGHT[3], seed=4, scale=0.3)
    prompts = ["the fleet reads", "a queue of requests"]
    source = write_jsonl(tmp_path / "in.jsonl", [
        {"custom_id": f"{model}-{i}", "method": "POST", "url": "/v1/completions",
         "body": {"model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0}}
        for model in ("sql", "base") for i, prompt in enumerate(prompts)])
    out = tmp_path / "out.jsonl"
    assert main([str(source), "-o", str(out), "--model", tiny_llama, "--served-model-name", "base", "--dtype",
                 "float32", "--num-kv-blocks", "64", "--enable-lora", "--max-lora-rank", "64",
                 "--lora-modules", f"sql={folder}"]) == 0
    llm = LLM(tiny_llama, num_kv_blocks=64, enable_lora=True, max_lora_rank=64)
    params = SamplingParams(temperature=0, max_tokens=6)
    expected = {f"sql-{i}": o.text for i, o in enumerate(llm.generate(
        prompts, params, use_tqdm=False, lora_request=LoRARequest("sql", 1, str(folder))))}
    expected |= {f"base-{i}": o.text for i, o in enumerate(llm.generate(prompts, params, use_tqdm=False))}
    lines = read_jsonl(out)
    assert {line["custom_id"]: line["response"]["body"]["choices"][0]["text"] for line in lines} == expected
    assert {line["response"]["body"]["model"] for line in lines} == {"sql", "base"}
    assert expected["sql-0"] != expected["base-0"] or expected["sql-1"] != expected["base-1"]


HUGE = 18446744073709551616  # 2**64: past every integer a tensor takes


def test_a_value_no_engine_can_take_is_named_and_never_breaks_the_run(tiny_llama, tmp_path, capsys, monkeypatch):
    """The top_k that once overflowed inside the sampler is refused at validation; and a request
    that breaks a step anyway (here a sampler failing on its seed) gets its own error line."""
    from tests.engine.test_isolation import POISON_SEED, PoisonedSampler  # noqa: PLC0415

    source = write_jsonl(tmp_path / "in.jsonl", [
        {"custom_id": "fine", "prompt": "hello", "max_tokens": 3, "temperature": 0},
        {"custom_id": "huge", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "hello", "max_tokens": 3, "top_k": HUGE}},
    ])
    out = tmp_path / "out.jsonl"
    assert main([str(source), "-o", str(out), "--model", tiny_llama]) == 1
    assert f"{source}:2: body.top_k: Input should be less than or equal to 2147483647" in capsys.readouterr().err
    assert main([str(source), "-o", str(out), "--model", tiny_llama, "--skip-invalid"]) == 0
    lines = {line["custom_id"]: line for line in read_jsonl(out)}
    assert lines["huge"]["error"]["code"] == "invalid_request" and lines["fine"]["error"] is None

    original = LLMEngine.step

    def poisoned_step(engine):
        if not isinstance(engine.model_runner.sampler, PoisonedSampler):
            engine.model_runner.sampler = PoisonedSampler(engine.model_runner.sampler,
                                                          lambda row: row.params.seed == POISON_SEED)
        return original(engine)

    monkeypatch.setattr(LLMEngine, "step", poisoned_step)
    write_jsonl(source, [{"custom_id": "fine", "prompt": "hello", "max_tokens": 3, "temperature": 0},
                         {"custom_id": "poisoned", "prompt": "hello", "max_tokens": 3, "seed": POISON_SEED}])
    assert main([str(source), "-o", str(out), "--model", tiny_llama]) == 0
    lines = {line["custom_id"]: line for line in read_jsonl(out)}
    assert lines["poisoned"]["error"]["code"] == "engine_error"
    assert lines["fine"]["response"]["body"]["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("parsers, reasoning", [([], "The river is wide"), (["--reasoning-parser", "none"], None)])
def test_responses_and_tool_lines_read_by_the_parsers(tmp_path, monkeypatch, parsers, reasoning):
    """A thinking model's lines (forced to think and call a tool: tests/chat_models.py), read by the
    model type's parsers, or, with --reasoning-parser none, its thinking left in the text."""
    path = write_thinking_model("qwen3", tmp_path / "qwen3")
    script = ('<think>\nThe river is wide\n</think>\n\nYes.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n'
              "</tool_call>")

    def scripted_engine(config):
        engine = create_engine(config)
        engine.model_runner.sampler = ScriptedSampler(engine.model_runner.sampler, engine.tokenizer,
                                                      {"river": script}, "<|im_end|>")
        return engine

    monkeypatch.setattr("workers.run_batch.create_engine", scripted_engine)
    tool = {"name": "f", "description": "F", "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}
    source = write_jsonl(tmp_path / "in.jsonl", [
        {"custom_id": "r", "method": "POST", "url": "/v1/responses",
         "body": {"input": "Is the river wide?", "tools": [{"type": "function", **tool}], "max_output_tokens": 80}},
        {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": "Is the river wide?"}], "max_tokens": 80,
                  "tools": [{"type": "function", "function": tool}]}}])
    out = tmp_path / "out.jsonl"
    assert main([str(source), "-o", str(out), "--model", path, "--num-kv-blocks", "64", *parsers]) == 0
    lines = {line["custom_id"]: line["response"]["body"] for line in read_jsonl(out)}
    response = Response.model_validate(lines["r"])
    message = lines["c"]["choices"][0]["message"]
    assert message.get("reasoning_content") == reasoning
    assert message["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"x": 1}'}
    assert [item.type for item in response.output] == (["reasoning"] if reasoning else []) + [
        "message", "function_call"]
    assert (message["content"] == "Yes.\n") == (reasoning is not None)
