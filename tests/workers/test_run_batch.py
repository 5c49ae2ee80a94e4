"""`python -m engine MODEL FILE`: outputs in input order, a request that cannot fit gets
its own error object, and malformed lines are named by line and field (jobs.schemas, as
producers.submit names them) before anything runs."""

from __future__ import annotations

import json
import sys

import pytest

from engine import LLM, SamplingParams
from engine.__main__ import main


def run_cli(monkeypatch, capsys, model: str, path, *flags: str) -> list[dict]:
    monkeypatch.setattr(sys, "argv", ["python -m engine", model, str(path), "--num-kv-blocks", "64", *flags])
    main()
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def test_outputs_in_order_and_an_oversized_request_gets_its_own_error(tiny_llama, tmp_path, monkeypatch, capsys):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join([
        json.dumps({"custom_id": "a", "prompt": "hello world", "max_tokens": 5}),
        json.dumps({"custom_id": "too-long", "prompt": "hi", "max_tokens": 100000}),
        "",
        json.dumps({"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
                    "body": {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}}),
        json.dumps({"prompt": "the cat"}),
    ]) + "\n")
    lines = run_cli(monkeypatch, capsys, tiny_llama, path, "--max-tokens", "3")
    assert [line["custom_id"] for line in lines] == ["a", "too-long", "chat", "line-5"]
    assert lines[1]["error"]["code"] == "context_length_exceeded" and "max_tokens 100000" in lines[1]["error"]["message"]
    assert [line["completion_tokens"] for line in (lines[0], lines[2], lines[3])] == [5, 4, 3]
    expected = LLM(tiny_llama, num_kv_blocks=64).generate(["hello world"], SamplingParams(temperature=0, max_tokens=5),
                                                          use_tqdm=False)[0]
    assert lines[0]["text"] == expected.text


def test_malformed_lines_are_named_and_nothing_runs(tiny_llama, tmp_path, monkeypatch, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join([
        json.dumps({"prompt": "fine"}),
        "{not json",
        json.dumps({"custom_id": "x"}),
        json.dumps({"prompt": "p", "max_tokens": 0}),
        json.dumps(["a list"]),
        json.dumps({"prompt": "p", "min_tokens": 9, "max_tokens": 2}),  # fields valid alone, not together
    ]) + "\n")
    with pytest.raises(SystemExit) as exit_info:
        run_cli(monkeypatch, capsys, tiny_llama, path)
    message = str(exit_info.value)
    assert f"{path}:2: line: not valid JSON" in message
    assert f"{path}:3: prompt:" in message
    assert f"{path}:4: max_tokens:" in message
    assert f"{path}:5: line: must be a JSON object" in message
    assert f"{path}:6: body: min_tokens" in message
    assert ":1:" not in message
    assert capsys.readouterr().out == ""
