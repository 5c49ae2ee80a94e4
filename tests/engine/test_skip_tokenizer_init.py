"""Checkpoints without a tokenizer: skip_tokenizer_init runs token-id prompts (outputs carry
token ids, text stays empty, as in vLLM); without it, a one-line error names the missing
files and the flag."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from workers.run_batch import main as run_batch

PROMPTS = [[1, 17, 250, 33, 9], [1, 400, 401, 402, 403, 404, 405, 406, 407]]


@pytest.fixture(scope="module")
def weights_only(tiny_llama, tmp_path_factory) -> str:
    """The tiny Llama's config and weights, without its tokenizer files."""
    folder = tmp_path_factory.mktemp("weights-only")
    for path in Path(tiny_llama).iterdir():
        if path.name.startswith(("config", "generation_config", "model")):
            shutil.copy(path, folder / path.name)
    return str(folder)


def test_without_the_flag_a_one_line_error_names_the_files_and_the_flag(weights_only):
    with pytest.raises(ValueError) as error:
        LLM(weights_only, num_kv_blocks=32)
    message = str(error.value)
    assert "\n" not in message
    assert "tokenizer.json" in message and "--skip-tokenizer-init" in message and weights_only in message


def test_token_ids_in_token_ids_out_equal_to_the_run_with_a_tokenizer(weights_only, tiny_llama):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    bare = LLM(weights_only, skip_tokenizer_init=True, num_kv_blocks=32)
    assert bare.get_tokenizer() is None
    got = bare.generate(PROMPTS, params, use_tqdm=False)
    expected = LLM(tiny_llama, num_kv_blocks=32).generate(PROMPTS, params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert all(o.text == "" and len(o.token_ids) == 8 for o in got)
    with pytest.raises(ValueError, match="text prompt needs a tokenizer"):
        bare.generate("hello", params, use_tqdm=False)
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        bare.generate(PROMPTS[0], SamplingParams(stop=["x"]), use_tqdm=False)


def test_run_batch_without_a_tokenizer_returns_token_ids(weights_only, tiny_llama, tmp_path, capsys):
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join(json.dumps(line) for line in [
        {"custom_id": "ids", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": 1}},
        {"custom_id": "text", "prompt": "needs a tokenizer"},
        {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": "hi"}]}},
    ]) + "\n")
    assert run_batch([str(source), "-o", "-", "--model", weights_only]) == 2
    assert "--skip-tokenizer-init" in capsys.readouterr().err
    assert run_batch([str(source), "-o", "-", "--model", weights_only, "--skip-tokenizer-init"]) == 0
    lines = {line["custom_id"]: line for line in map(json.loads, capsys.readouterr().out.splitlines())}
    choice = lines["ids"]["response"]["body"]["choices"][0]
    expected = LLM(tiny_llama, num_kv_blocks=32).generate(
        PROMPTS[0], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)[0]
    assert choice["text"] == "" and choice["token_ids"] == expected.token_ids
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in expected.token_ids]
    for custom_id, field in (("text", "prompt"), ("chat", "messages")):
        assert lines[custom_id]["error"]["code"] == "invalid_request"
        assert lines[custom_id]["error"]["message"].startswith(f"{field}: this worker runs without a tokenizer")
