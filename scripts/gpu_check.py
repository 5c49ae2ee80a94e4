"""Every GPU check and timing of kvfleet in one run, for the minutes a GPU machine is lent.

    python scripts/gpu_check.py --out DIR              # on a CUDA machine (make gpu-check)
    python scripts/gpu_check.py --out DIR --dry-run    # the same steps on the CPU, tiny sizes

It needs only the engine's own dependencies (torch, triton, transformers, safetensors,
tokenizers, pytest), which a GPU machine's image has; nothing is installed. Five parts,
each in its own process with its own timeout, so one failure loses nothing else:

  kernels       pytest tests/kvfleet_kernels on the GPU, without TRITON_INTERPRET
  parity        the engine on the GPU: greedy fp32 token-identical to transformers on the
                tiny checkpoints of every architecture; bf16 under vLLM's check_logprobs_close
                rule; the triton backend with preemption and with prefix caching; two LoRA
                adapters and the base in one batch (SGMV) against the adapters merged
  kernel_bench  benchmarks/kernels_gpu.py: decode attention against the measured copy
                bandwidth (and a sweep of its tile / split-K / warps plans), prefill TFLOP/s,
                embeddings' packed (varlen) attention, SDPA as the peer
  engine_bench  benchmarks/engine_gpu.py: a ~1.1B random Llama in bf16 against transformers,
                then a profile of its decode steps (host functions, device kernels)
  moe_bench     benchmarks/moe.py: a ~103M Qwen3-MoE (a quarter active) in bf16 against
                transformers, its decode steps against the touched weights' roofline and the
                step size where its expert matmuls stop being weight-bound (fused-MoE kernel)

Writes DIR/report.json (every part's status, seconds and numbers), DIR/summary.txt and
one log per part. It stays within 8 minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# Seconds each part may take on the GPU: 8 minutes in all. The dry run gets twice as long:
# it interprets the kernels on whatever CPU the tests run on (parity, two architectures, ~31 s on
# a 2-core AVX2 host).
# Sized from the first CUDA run (H200, 2026-12-04): kernels 81 s of tests under 8 workers,
# parity ~11 s an architecture at 24 prompts, the kernel sweep 27 s, the engine against static
# generate ~90 s, MoE ~50 s.
PARTS = {"kernels": 130, "parity": 120, "kernel_bench": 50, "engine_bench": 120, "moe_bench": 60}
DRY_RUN_TIME_SCALE = 2
# The dry run's parity: a dense model (with the triton backend's preemption, prefix-cache and LoRA
# checks) and an MoE one with sinks run every line of it; the CPU engine's parity on every
# architecture is tests/engine/test_parity.py's.
DRY_RUN_ARCHS = ("llama", "gpt_oss")
NUM_TOKENS = 16


def run_kernels(dry_run: bool) -> dict:
    junit = Path(tempfile.mkdtemp(prefix="kvfleet-kernels-")) / "kernels.xml"  # not in out: only 8 files come back
    # test_cpu_*: the native CPU kernels, which make test covers; test_cuda_compile: nvcc's build check.
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/kvfleet_kernels",
               "--ignore=tests/kvfleet_kernels/test_cuda_compile.py", "--ignore-glob=*/test_cpu_*.py",
               "--tb=short", "-rfE", f"--junitxml={junit}"]
    if dry_run:
        command += ["-k", "store_kv or rms_norm or rotary or sgmv"]  # the interpreter is slow; the rest run in make test
    else:
        command += ["-n", "8"]  # the GPU machine's cores compile the kernels
    sys.stdout.flush()
    result = subprocess.run(command, cwd=ROOT)  # into this part's log as it runs: a timeout keeps what ran
    import xml.etree.ElementTree as ElementTree

    suite = ElementTree.parse(junit).getroot().find("testsuite")
    counts = {name: int(suite.get(name, 0)) for name in ("tests", "failures", "errors", "skipped")}
    if result.returncode != 0:
        raise SystemExit(f"pytest tests/kvfleet_kernels: {counts}")
    return counts


def logprobs_close(a_tokens, a_top, b_tokens, b_top) -> tuple[bool, int | None]:
    """vLLM's check_logprobs_close: up to the first divergence the tokens are equal; there,
    each side's token must be among the other's top-5 candidates, and comparison stops.
    Returns (close, position of the first divergence or None)."""
    for position, (a, b) in enumerate(zip(a_tokens, b_tokens)):
        if a != b:
            return a in b_top[position] and b in a_top[position], position
    return True, None


def unexpressible(config) -> str | None:
    """Why the installed transformers cannot be the reference for a tiny config, or None: before
    gpt-oss's SwiGLU clamp became config fields, its model hard-coded them (1.702, 7.0), and the
    tiny config sets a lower limit so that random activations reach it."""
    import transformers

    fields = ("swiglu_alpha", "swiglu_limit") if config.model_type == "gpt_oss" else ()
    missing = [name for name in fields if not hasattr(type(config)(), name)]
    return f"transformers {transformers.__version__} hard-codes {missing}" if missing else None


def run_parity(dry_run: bool) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from engine import LLM, SamplingParams
    from engine.demo_model import build_tokenizer, write_checkpoint
    from kvfleet_kernels import cdiv
    from tests.tiny_models import TINY_CONFIGS, VOCAB

    device = "cpu" if dry_run else "cuda"
    backend = "torch" if dry_run else "triton"
    rng = random.Random(5)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(5, 60))] for _ in range(4 if dry_run else 16)]
    folder, tokenizer, report = Path(tempfile.mkdtemp(prefix="kvfleet-parity-")), build_tokenizer(VOCAB), {}

    def reference(model_dir, dtype):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
        tokens, tops = [], []
        for prompt in prompts:
            generated = model.generate(torch.tensor([prompt], device=device), do_sample=False,
                                       max_new_tokens=NUM_TOKENS, min_new_tokens=NUM_TOKENS, pad_token_id=0,
                                       output_logits=True, return_dict_in_generate=True)
            tokens.append(generated.sequences[0, len(prompt):].tolist())
            tops.append([set(step[0].float().topk(5).indices.tolist()) for step in generated.logits])
        return tokens, tops

    greedy = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=5)
    for arch, make_config in TINY_CONFIGS.items():
        config = make_config()
        if dry_run and arch not in DRY_RUN_ARCHS:
            report[arch] = {"skipped": "not in the dry run"}
            continue
        if reason := unexpressible(config):
            report[arch] = {"skipped": reason}
            continue
        model_dir = write_checkpoint(config, folder / arch, seed=1, tokenizer=tokenizer)
        expected, expected_tops = reference(model_dir, torch.float32)
        got = LLM(str(model_dir), dtype="float32", device=device, attention_backend=backend, num_kv_blocks=512)
        fp32 = got.generate(prompts, greedy, use_tqdm=False)
        tokens = [o.token_ids for o in fp32]
        fp32_close = [logprobs_close(o.token_ids, [set(p) for p in o.logprobs], e, t)
                      for o, e, t in zip(fp32, expected, expected_tops)]
        bf16_expected, bf16_tops = reference(model_dir, torch.bfloat16)
        bf16 = LLM(str(model_dir), dtype="bfloat16", device=device, attention_backend=backend, num_kv_blocks=512)
        outputs = bf16.generate(prompts, greedy, use_tqdm=False)
        close = [logprobs_close(o.token_ids, [set(p) for p in o.logprobs], e, t)
                 for o, e, t in zip(outputs, bf16_expected, bf16_tops)]
        report[arch] = {"fp32_identical": sum(a == b for a, b in zip(tokens, expected)) / len(prompts),
                        "fp32_close": sum(ok for ok, _ in fp32_close) / len(prompts),
                        "bf16_close": sum(ok for ok, _ in close) / len(prompts),
                        "bf16_identical": sum(at is None for _, at in close) / len(prompts)}
        print(arch, json.dumps(report[arch]), flush=True)  # in the log as it goes: a timeout keeps it
        if arch == "llama":  # the triton backend under pressure: preemption, then a cached prefix
            few = prompts[:3] if dry_run else prompts  # the interpreter runs a launch in ~0.1 s
            # A pool two blocks larger than the largest request: running them together must preempt.
            pool = max(cdiv(len(p) + NUM_TOKENS, 16) for p in few) + 2
            small = LLM(str(model_dir), dtype="float32", device=device, attention_backend="triton",
                        num_kv_blocks=pool, max_num_seqs=8, enable_prefix_caching=True)
            pressured = [o.token_ids for o in small.generate(few, greedy, use_tqdm=False)]
            shared = [prompts[0][:48] + p[:8] for p in few]
            uncached = LLM(str(model_dir), dtype="float32", device=device, attention_backend="triton",
                           num_kv_blocks=512, enable_prefix_caching=False)
            cold = [o.token_ids for o in uncached.generate(shared, greedy, use_tqdm=False)]
            cached_llm = LLM(str(model_dir), dtype="float32", device=device, attention_backend="triton",
                             num_kv_blocks=512)
            cached_llm.generate(shared[:1], greedy, use_tqdm=False)  # its prefix blocks are cached now
            warm = cached_llm.generate(shared, greedy, use_tqdm=False)
            report["triton_preemption"] = {"identical": pressured == tokens[:len(few)],
                                           "num_preemptions": small.engine.stats().num_preemptions}
            report["triton_prefix_cache"] = {"identical": [o.token_ids for o in warm] == cold,
                                             "cached_tokens": sum(o.num_cached_tokens for o in warm)}
            report["lora"] = lora_parity(model_dir, prompts[:3] if dry_run else prompts, device, backend)
    print(json.dumps(report, indent=2))
    # fp32 may flip a near-tie where summation order differs; vLLM's rule judges it, and
    # fp32_identical reports the exact share.
    failures = [arch for arch, numbers in report.items() if numbers.get("fp32_close", 1) < 1
                or numbers.get("lora_close", 1) < 1 or numbers.get("lora_changed", 1) == 0
                or numbers.get("bf16_close", 1) < 1 or numbers.get("identical") is False
                or numbers.get("num_preemptions", 1) == 0]
    if failures:
        raise SystemExit(f"parity failed for {failures}: {report}")
    return report


def lora_parity(model_dir: Path, prompts: list[list[int]], device: str, backend: str) -> dict:
    """Two random adapters and the base in one batch (the LoRA layers' Triton SGMV on CUDA)
    against transformers with each adapter merged by hand (W += alpha / r * B @ A: peft is
    not in a GPU image), under vLLM's close-logprobs rule."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from benchmarks.multi_lora import write_random_adapter
    from engine import LLM, LoRARequest, SamplingParams

    config, folder = AutoConfig.from_pretrained(model_dir), Path(tempfile.mkdtemp(prefix="kvfleet-lora-"))
    adapters = [LoRARequest(f"a{i}", i + 1, str(write_random_adapter(folder / f"a{i}", config, 8, seed=i, b_scale=0.2)))
                for i in range(2)]
    greedy = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=5)
    which = [None, *adapters] * (len(prompts) // 3 + 1)
    llm = LLM(str(model_dir), dtype="float32", device=device, attention_backend=backend, num_kv_blocks=512,
              enable_lora=True, max_loras=2, max_lora_rank=8)
    outputs = llm.generate(prompts, greedy, use_tqdm=False, lora_request=which[:len(prompts)])
    base = llm.generate(prompts, greedy, use_tqdm=False)
    changed = [o.token_ids != b.token_ids for o, b, lora in zip(outputs, base, which) if lora is not None]
    close = []
    for prompt, lora, output in zip(prompts, which, outputs):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        if lora is not None:
            tensors = load_file(Path(lora.lora_path) / "adapter_model.safetensors")
            params = dict(model.named_parameters())
            for name, a in tensors.items():
                if ".lora_A." in name:
                    b = tensors[name.replace(".lora_A.", ".lora_B.")]
                    target = name.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
                    params[target].data += 2.0 * (b @ a)  # lora_alpha = 2 r
        generated = model.to(device).eval().generate(
            torch.tensor([prompt], device=device), do_sample=False, max_new_tokens=NUM_TOKENS,
            min_new_tokens=NUM_TOKENS, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        tops = [set(step[0].float().topk(5).indices.tolist()) for step in generated.logits]
        close.append(logprobs_close(output.token_ids, [set(p) for p in output.logprobs],
                                    generated.sequences[0, len(prompt):].tolist(), tops)[0])
    return {"lora_close": sum(close) / len(close), "lora_changed": sum(changed) / len(changed),
            "lora_loads": llm.engine.stats().num_lora_loads}


def run_benchmark(module: str, dry_run: bool, *extra: str) -> dict:
    result_file = Path(tempfile.mkdtemp(prefix="kvfleet-bench-")) / "result.json"  # not in out: 8 files come back
    command = [sys.executable, "-m", module, "--json", str(result_file), *(["--dry-run"] if dry_run else []), *extra]
    subprocess.run(command, cwd=ROOT, check=True)
    report = json.loads(result_file.read_text())
    result_file.unlink()
    return report


def run_part(name: str, dry_run: bool) -> dict:
    if name == "kernels":
        return run_kernels(dry_run)
    if name == "parity":
        return run_parity(dry_run)
    if name == "engine_bench":  # the goal's peer only: transformers' continuous batching took 77 s alone
        return run_benchmark("benchmarks.engine_gpu", dry_run, "--peers", "static")
    return run_benchmark({"kernel_bench": "benchmarks.kernels_gpu", "moe_bench": "benchmarks.moe"}[name], dry_run)


def drive(out: Path, dry_run: bool, parts: list[str]) -> dict:
    """Each part in a child process with its own timeout and log; then report.json and summary.txt."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    if dry_run:
        env["TRITON_INTERPRET"] = "1"
    else:
        env.pop("TRITON_INTERPRET", None)
        env["KVFLEET_TEST_DEVICE"] = "cuda"
    report = {"dry_run": dry_run, "parts": {}}
    for name in parts:
        started, log = time.monotonic(), out / f"{name}.log"
        with open(log, "w") as handle:
            try:
                process = subprocess.run([sys.executable, __file__, "--part", name, "--out", str(out),
                                          *(["--dry-run"] if dry_run else [])], cwd=ROOT, env=env, stdout=handle,
                                         stderr=subprocess.STDOUT,
                                         timeout=PARTS[name] * (DRY_RUN_TIME_SCALE if dry_run else 1))
                status = "ok" if process.returncode == 0 else "failed"
            except subprocess.TimeoutExpired:
                status = "timeout"
        result_file = out / f"{name}.result.json"
        result = json.loads(result_file.read_text()) if result_file.exists() else None
        result_file.unlink(missing_ok=True)
        report["parts"][name] = {"status": status, "seconds": round(time.monotonic() - started, 1),
                                 "result": result, "log_tail": log.read_text()[-1500:] if status != "ok" else ""}
        print(f"{name}: {status} in {report['parts'][name]['seconds']} s", flush=True)
    (out / "report.json").write_text(json.dumps(report, indent=2))
    lines = [f"kvfleet gpu_check ({'dry run on the CPU' if dry_run else 'CUDA'})"]
    for name, part in report["parts"].items():
        lines.append(f"{name}: {part['status']} ({part['seconds']} s)")
    bench = (report["parts"].get("kernel_bench") or {}).get("result") or {}
    if bench.get("decode_goal_fraction") is not None:
        lines.append(f"decode attention at batch 64 x 4096: {bench['decode_goal_fraction']:.0%} of the copy bandwidth")
    for bench_part in ("engine_bench", "moe_bench"):
        result = (report["parts"].get(bench_part) or {}).get("result") or {}
        for ratio, value in (result.get("ratios") or {}).items():
            lines.append(f"{bench_part} {ratio}: {value:.2f}x")
    (out / "summary.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for report.json, summary.txt and the logs")
    parser.add_argument("--dry-run", action="store_true", help="on the CPU at tiny sizes, kernels interpreted")
    parser.add_argument("--part", choices=list(PARTS), help="run one part in this process (the driver's child)")
    parser.add_argument("--only", nargs="+", choices=list(PARTS), help="run only these parts")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.part:
        result = run_part(args.part, args.dry_run)
        (out / f"{args.part}.result.json").write_text(json.dumps(result))
        return 0
    if not args.dry_run:
        import torch

        if not torch.cuda.is_available():
            print("gpu_check: no CUDA device here; use --dry-run to check the script on the CPU", file=sys.stderr)
            return 2
    report = drive(out, args.dry_run, args.only or list(PARTS))
    return 0 if all(part["status"] == "ok" for part in report["parts"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
