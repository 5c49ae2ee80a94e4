"""The analytic counts the benchmarks divide by: FLOPs per token against a real
transformers model's parameter counts, and the decode-step roofline at its two limits."""

from __future__ import annotations

import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from benchmarks.common import (
    decode_step_flops,
    decode_step_roofline_seconds,
    flops_per_token,
    llama_50m_config,
    sampled_matmul_speed,
    slow_share,
)


@pytest.fixture(scope="module")
def config_and_params():
    config = llama_50m_config()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    linear_weights = sum(m.weight.numel() for name, m in model.named_modules()
                         if isinstance(m, torch.nn.Linear) and name != "lm_head")
    return config, linear_weights, model.lm_head.weight.numel()


def test_flops_per_token_are_two_per_weight(config_and_params):
    config, linear_weights, lm_head_weights = config_and_params
    linear, lm_head, attention = flops_per_token(config)
    assert linear == 2 * linear_weights and lm_head == 2 * lm_head_weights
    # QK^T and PV: 2 FLOPs each per query-head dimension per layer, for each context token.
    assert attention == 4 * config.num_attention_heads * (config.hidden_size // config.num_attention_heads) \
        * config.num_hidden_layers


def test_roofline_is_the_matmul_time_when_memory_is_free():
    config, contexts = llama_50m_config(), [100, 700, 33]
    seconds = decode_step_roofline_seconds(config, contexts, matmul_flops=1e11, read_bytes_per_s=1e30)
    assert seconds == pytest.approx(decode_step_flops(config, contexts) / 1e11, rel=1e-12)


def test_roofline_is_the_bytes_read_when_compute_is_free(config_and_params):
    config, linear_weights, lm_head_weights = config_and_params
    contexts = [100, 700, 33]
    kv_bytes = sum(contexts) * 2 * config.num_hidden_layers * config.num_key_value_heads \
        * (config.hidden_size // config.num_attention_heads) * 4  # K and V, fp32
    seconds = decode_step_roofline_seconds(config, contexts, matmul_flops=1e30, read_bytes_per_s=1e9)
    assert seconds == pytest.approx((kv_bytes + 4 * (linear_weights + lm_head_weights)) / 1e9, rel=1e-12)


def test_the_cpu_linear_benchmark_passes_over_every_decoder_weight(config_and_params):
    """benchmarks/cpu_linears.py's fused shapes hold exactly the model's decoder linear weights,
    so its GB/s and GFLOP/s divide by the bytes and products a decode step really has."""
    from benchmarks.cpu_linears import decoder_shapes  # noqa: PLC0415

    config, linear_weights, _ = config_and_params
    assert config.num_hidden_layers * sum(i * o for i, o in decoder_shapes(config)) == linear_weights


def test_the_prefill_attention_benchmark_counts_the_causal_triangle_and_times_like_with_like():
    """benchmarks/cpu_prefill_attention.py divides by the scores a causal mask keeps (new positions
    after cached ones), and every system it times computes the same attention as SDPA."""
    from benchmarks.cpu_prefill_attention import causal_flops, make_systems  # noqa: PLC0415

    num_new, num_cached, num_heads, head_dim = 21, 40, 4, 64
    kept = torch.ones(num_new, num_cached + num_new).tril(diagonal=num_cached).sum().item()
    assert causal_flops(num_new, num_cached, num_heads, head_dim) == 4 * head_dim * num_heads * kept
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(num_new, num_heads, head_dim, generator=generator).bfloat16()
    key, value = (torch.randn(num_cached + num_new, 2, head_dim, generator=generator).bfloat16() for _ in range(2))
    outputs = {name: call() for name, call in make_systems(query, key, value, head_dim ** -0.5).items()}
    for name, output in outputs.items():
        torch.testing.assert_close(output.float(), outputs["sdpa"].float(), atol=2e-2, rtol=2e-2, msg=name)


def test_the_slow_share_counts_samples_under_the_threshold():
    # 60% of 1,100 is 660: 450 and 600 are slow, 700 and 1,100 are not.
    assert slow_share([1100e9, 450e9, 700e9, 600e9], best=1100e9) == 0.5
    assert slow_share([], best=1100e9) == 0.0


def test_the_matmul_sampler_samples_through_the_block_and_stops_with_it():
    """benchmarks/matmul_sampler.py in its own process, every 20 ms while the block runs: its
    figures are a tiny matmul's FLOP/s, and none come once the block has ended."""
    with sampled_matmul_speed(torch.float32, interval=0.02, size=64) as samples:
        deadline = time.monotonic() + 120  # the sampler imports torch first
        while len(samples) < 5 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(samples) >= 5
    taken = len(samples)
    time.sleep(0.2)
    assert len(samples) == taken
    assert all(1e6 < sample < 1e13 for sample in samples)  # 64^3 products: MFLOP/s to TFLOP/s


def test_repeats_keep_each_systems_fastest_run_and_print_every_runs_slow_share(capsys):
    """engine_throughput --repeats: rounds interleaved, the fastest run kept, and every run's
    output tokens/s with the share of its samples in the slow mode printed beside it."""
    from benchmarks.engine_throughput import interleaved_runs, print_workload  # noqa: PLC0415

    speeds = iter([400.0, 300.0, 700.0, 280.0])  # round 1: kvfleet, peer; round 2: kvfleet, peer
    samples = iter([[400e9, 1000e9], [1000e9, 1000e9], [1000e9, 1000e9], [400e9, 400e9]])
    order = []

    def run(command, dtype):
        order.append(command)
        return {"output_tokens_per_s": next(speeds), "sampled_matmul_flops": next(samples),
                "user_s": 1.0, "sys_s": 0.0}

    results = interleaved_runs({"kvfleet": "k", "peer": "p"}, ["bfloat16"], 2, run)
    assert order == ["k", "p", "k", "p"]
    assert results["kvfleet"]["bfloat16"]["output_tokens_per_s"] == 700.0
    assert results["peer"]["bfloat16"]["output_tokens_per_s"] == 300.0
    assert [r["output_tokens_per_s"] for r in results["peer"]["bfloat16"]["runs"]] == [300.0, 280.0]
    print_workload("chat", results, {"peer": 700.0 / 300.0})
    printed = capsys.readouterr().out
    assert "bfloat16 every run: 400.0 (slow 50%), 700.0 (slow 0%)" in printed
    assert "bfloat16 every run: 300.0 (slow 0%), 280.0 (slow 100%)" in printed
    assert "kvfleet best / peer best: 2.33x" in printed


def test_decode_step_figures_divide_by_the_roofline_at_the_given_read_probe(capsys):
    """engine_throughput's decode-only figure: the steps' roofline at the read probe it is given
    (the best reading up to that workload's end) over their seconds, with that probe printed."""
    from benchmarks.engine_throughput import kvfleet_step_figures, print_steps  # noqa: PLC0415

    config = llama_50m_config()
    rows = [[1, 99], [1, 699]]  # two decodes over 100 and 700 positions
    result = {"steps": [{"rows": [[64, 0]], "seconds": 0.5}, {"rows": rows, "seconds": 0.02}]}
    figures = kvfleet_step_figures(result, config, probe=1e11, bandwidth=25e9, dtype="bfloat16")
    roofline = decode_step_roofline_seconds(config, [100, 700], 1e11, 25e9, dtype_bytes=2)
    assert "steps" not in result and figures["read_probe_bytes_per_s"] == 25e9
    assert figures["decode_steps"]["fraction_of_roofline"] == pytest.approx(roofline / 0.02, rel=1e-12)
    assert figures["prefill_steps"]["steps"] == 1 and figures["decode_steps"]["mean_batch"] == 2
    print_steps("chat", "bfloat16", figures)
    assert f"decode-only steps (mean batch 2.0) {roofline / 0.02:.0%} of their roofline (read probe 25.0 GB/s" \
        in capsys.readouterr().out
