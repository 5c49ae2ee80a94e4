"""Decode steps replayed from CUDA graphs (engine/cuda_graphs.py): the same greedy tokens and
the same KV cache, bit for bit, as eager steps. On a GPU (scripts/gpu_check.py) the runner
captures real graphs; on the CPU the Triton interpreter runs the kernels and a stand-in
replays a captured step by calling it again through the same static buffers, so the padding,
the buffer copies and the choice of graph are what these tests check there."""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams, cuda_graphs
from engine.cuda_graphs import capture_sizes, ineligible_reason


class ReplayByCalling:
    """The CPU's stand-in for torch.cuda.CUDAGraph: replay runs the captured forward again,
    reading the static inputs and writing the output the capture returned."""

    def capture(self, forward):
        self.forward = forward
        self.output = forward()
        return self.output

    def replay(self) -> None:
        self.output.copy_(self.forward())


def graph_llm(model: str, **options) -> LLM:
    llm = LLM(model, attention_backend="triton", enforce_eager=False, **options)
    runner = llm.engine.model_runner
    if runner.device.type == "cuda":
        assert runner.decode_graphs is not None  # captured at start-up
    else:
        assert runner.decode_graphs is None  # not a CUDA device: the stand-in instead
        runner.decode_graphs = runner.capture_decode_graphs(ReplayByCalling)
    return llm


def requests(count: int):
    rng = random.Random(count)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randrange(1, 70))] for _ in range(count)]
    # Outputs of different lengths: the batch shrinks as requests end, over padded sizes.
    params = [SamplingParams(temperature=0, max_tokens=4 + 2 * i, ignore_eos=True) for i in range(count)]
    return prompts, params


def record_choices(llm: LLM, monkeypatch) -> list[tuple[bool, int, int | None]]:
    """Per step from now on: (carries a prefill, rows, the graph size it ran on or None)."""
    graphs, steps = llm.engine.model_runner.decode_graphs, []
    padded_size = graphs.padded_size

    def recording(metas, num_tokens):
        steps.append((metas[0].num_prefill_tokens > 0, num_tokens, padded_size(metas, num_tokens)))
        return steps[-1][2]

    monkeypatch.setattr(graphs, "padded_size", recording)
    return steps


def test_capture_sizes_are_vllms():
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 4]
    assert capture_sizes(5) == [1, 2, 4, 8]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 24]
    assert capture_sizes(256)[-3:] == [240, 248, 256]


@pytest.mark.parametrize("arch", ["llama", "gemma3", "phi3"])  # one pool; local + global pools; longrope
def test_graph_steps_give_the_eager_tokens_and_cache(tiny_models, arch, monkeypatch):
    prompts, params = requests(5)  # batches of 5, 4, ... 1 rows: graphs of 8, 4, 4, 2, 1
    eager = LLM(tiny_models[arch], attention_backend="triton", num_kv_blocks=96, max_num_seqs=8)
    expected = [o.token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    replayed = graph_llm(tiny_models[arch], num_kv_blocks=96, max_num_seqs=8)
    steps = record_choices(replayed, monkeypatch)
    assert [o.token_ids for o in replayed.generate(prompts, params, use_tqdm=False)] == expected
    for eager_pool, graph_pool in zip(eager.engine.model_runner.kv_cache_groups,
                                      replayed.engine.model_runner.kv_cache_groups):
        if graph_pool.is_cuda:  # cuBLAS may pick another kernel for the padded row count
            torch.testing.assert_close(graph_pool, eager_pool, rtol=1e-5, atol=1e-5)
        else:  # padding rows wrote nothing, and every real row is computed alike
            assert torch.equal(eager_pool, graph_pool)
    # Every decode-only step ran on the smallest graph that holds it, every step with a prefill
    # (phi3 recomputes a sequence as it crosses to longrope's long factors) eagerly.
    assert all(size == (None if prefill else next(s for s in (1, 2, 4, 8) if s >= rows))
               for prefill, rows, size in steps)
    assert sum(size is not None for _, _, size in steps) >= 8


def test_long_sequences_and_prefills_run_eagerly(tiny_models, monkeypatch):
    """A step whose tables are wider than max_seq_len_to_capture tokens, or that carries a
    prefill, runs the eager forward; the outputs do not change."""
    monkeypatch.setattr(cuda_graphs, "MAX_SEQ_LEN_TO_CAPTURE", 48)
    rng = random.Random(3)
    # A 60-token prompt makes its steps too wide for the graphs until it ends (after 4 tokens).
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (5, 60, 9, 12, 3)]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (16, 4, 12, 14, 10)]
    eager = LLM(tiny_models["llama"], attention_backend="triton", num_kv_blocks=96, max_num_seqs=4)
    expected = [o.token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    llm = graph_llm(tiny_models["llama"], num_kv_blocks=96, max_num_seqs=4)
    graphs = llm.engine.model_runner.decode_graphs
    assert graphs.max_blocks == 3 and graphs.sizes == [1, 2, 4]
    steps = record_choices(llm, monkeypatch)
    assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected
    decode_sizes = [size for prefill, _, size in steps if not prefill]
    assert None in decode_sizes and {1, 2, 4} & set(decode_sizes)  # decodes past 48 tokens eager
    assert all(size is None for prefill, _, size in steps if prefill)


def test_what_cannot_be_captured_says_why(tiny_models):
    llama = LLM(tiny_models["llama"], attention_backend="torch").engine.model_runner
    cuda = torch.device("cuda")
    assert ineligible_reason(llama.model, cuda, "triton", 1, False) is None
    assert "CUDA device" in ineligible_reason(llama.model, torch.device("cpu"), "triton", 1, False)
    assert "torch attention backend" in ineligible_reason(llama.model, cuda, "torch", 1, False)
    assert "tensor parallelism" in ineligible_reason(llama.model, cuda, "triton", 2, False)
    assert "LoRA" in ineligible_reason(llama.model, cuda, "triton", 1, True)
    moe = LLM(tiny_models["qwen3_moe"], attention_backend="torch").engine.model_runner
    assert "mixture of experts" in ineligible_reason(moe.model, cuda, "triton", 1, False)
    assert llama.decode_graphs is None  # enforce_eager is the default until a GPU has run them


def test_a_failed_capture_leaves_the_engine_eager(tiny_models, monkeypatch, caplog):
    """A capture the driver refuses logs why and the engine serves eagerly, same tokens."""
    import engine.model_runner as model_runner  # noqa: PLC0415

    def refuse(self):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(model_runner, "ineligible_reason", lambda *args: None)  # as on a CUDA device
    monkeypatch.setattr(cuda_graphs, "cuda_graph_factory", lambda: ReplayByCalling)
    monkeypatch.setattr(cuda_graphs.DecodeGraphs, "capture", refuse)
    prompts, params = requests(2)
    expected = [o.token_ids for o in LLM(tiny_models["llama"], attention_backend="triton").generate(
        prompts, params, use_tqdm=False)]
    llm = LLM(tiny_models["llama"], attention_backend="triton", enforce_eager=False)
    assert llm.engine.model_runner.decode_graphs is None
    assert "capturing CUDA graphs failed: operation not permitted" in caplog.text
    assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected
