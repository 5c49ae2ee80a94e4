"""generation_config.json as vLLM reads it (--generation-config auto): its sampling fields
are the defaults of a request that leaves them unset, and the request always wins;
`vllm` ignores the file; every id of an eos_token_id list ends a sequence."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys

import pytest

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from jobs.schemas import Request
from workers.translate import to_engine_request

PROMPTS = [[5 + i, 40, 77 + i, 9] for i in range(6)]


@pytest.fixture
def with_generation_config(tiny_llama, tmp_path):
    """The tiny Llama with a generation_config.json of the test's choosing."""
    folder = tmp_path / "model"
    shutil.copytree(tiny_llama, folder)

    def write(**fields) -> str:
        (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "pad_token_id": 0, **fields}))
        return str(folder)

    return write


def test_the_files_values_fill_what_a_request_leaves_unset(with_generation_config, caplog):
    model = with_generation_config(eos_token_id=2, temperature=0.0, top_k=7, top_p=0.9, max_new_tokens=12)
    with caplog.at_level(logging.INFO, logger="engine.checkpoint"):
        llm = LLM(model, num_kv_blocks=64)
    assert llm.engine.default_sampling_params == {"temperature": 0.0, "top_k": 7, "top_p": 0.9, "max_tokens": 12}
    assert ("generation defaults from the model: {'temperature': 0.0, 'top_p': 0.9, 'top_k': 7, 'max_tokens': 12}"
            in caplog.text)  # said at start-up
    greedy = LLM(model, num_kv_blocks=64, generation_config="vllm").generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    defaulted = llm.generate(PROMPTS, use_tqdm=False)  # no SamplingParams: the file's (greedy, 12 tokens)
    assert [o.token_ids for o in defaulted] == [o.token_ids[: len(d.token_ids)] for o, d in zip(greedy, defaulted)]
    assert all(len(o.token_ids) == 12 or o.finish_reason == "stop" for o in defaulted)
    # Through the worker's path: a body without temperature samples as the file says; one with it as it says.
    body = {"prompt": PROMPTS[0], "max_tokens": 12}
    unset = to_engine_request(Request(custom_id="a", url="/v1/completions", body=body), None, llm.engine.default_sampling_params)
    own = to_engine_request(Request(custom_id="b", url="/v1/completions", body={**body, "temperature": 0.8, "seed": 1}), None,
                            llm.engine.default_sampling_params)
    assert (unset.params.temperature, unset.params.top_k, unset.params.top_p) == (0.0, 7, 0.9)
    assert (own.params.temperature, own.params.top_k, own.params.top_p) == (0.8, 7, 0.9)


def test_vllm_mode_and_a_bare_file_take_no_defaults(with_generation_config, tmp_path):
    model = with_generation_config(eos_token_id=2, temperature=0.3)
    assert LLM(model, num_kv_blocks=64, generation_config="vllm").engine.default_sampling_params == {}
    bare = with_generation_config(eos_token_id=2)  # transformers' own defaults (top_k=50) are no choice
    assert LLM(bare, num_kv_blocks=64).engine.default_sampling_params == {}
    other = tmp_path / "defaults"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"repetition_penalty": 1.2, "min_p": 0.05}))
    assert LLM(bare, num_kv_blocks=64, generation_config=str(other)).engine.default_sampling_params == {
        "repetition_penalty": 1.2, "min_p": 0.05}
    with pytest.raises(ValueError, match="generation_config: .* is not auto, vllm or a folder"):
        LLM(bare, num_kv_blocks=64, generation_config=str(tmp_path / "nowhere"))
    assert EngineConfig(model="m").generation_config == "auto"


def test_every_eos_id_of_a_list_ends_a_sequence(with_generation_config, tiny_llama):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    free = LLM(tiny_llama, num_kv_blocks=64).generate(PROMPTS, params, use_tqdm=False)
    stopper = free[0].token_ids[5]  # a token the first prompt produces sixth
    assert stopper != 2
    llm = LLM(with_generation_config(eos_token_id=[2, stopper]), num_kv_blocks=64)
    assert llm.engine.eos_token_ids == {2, stopper}
    out = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    first = next(i for i, token in enumerate(free[0].token_ids) if token in (2, stopper))
    assert out.token_ids == free[0].token_ids[: first + 1] and out.finish_reason == "stop"


def test_run_batch_says_what_the_engine_chose_where_its_user_sees_it(with_generation_config, tmp_path):
    """One line on stderr at start-up: the dtype, the attention path and the defaults taken."""
    model = with_generation_config(eos_token_id=2, temperature=0.3, max_new_tokens=5)
    lines = tmp_path / "in.jsonl"
    lines.write_text(json.dumps({"custom_id": "a", "prompt": "The river rose", "ignore_eos": True}) + "\n")
    done = subprocess.run([sys.executable, "-m", "workers.run_batch", str(lines), "-o", str(tmp_path / "out.jsonl"),
                           "--model", model, "--dtype", "float32", "--attention-backend", "torch",
                           "--num-kv-blocks", "64"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    chosen = next(line for line in done.stderr.splitlines() if "engine: LlamaForCausalLM" in line)
    assert "float32 on cpu, torch attention, 64 KV blocks of 16 tokens" in chosen
    assert "generation defaults: {'temperature': 0.3, 'max_tokens': 5} (from the checkpoint's " \
           "generation_config.json; a request's own values win)" in chosen
    assert json.loads((tmp_path / "out.jsonl").read_text())["response"]["body"]["usage"]["completion_tokens"] == 5
