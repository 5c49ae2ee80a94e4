"""scripts/gpu_check.py is known to work before any GPU time is spent: its dry run runs
every part on the CPU, one failing part loses nothing else, and its parity rule is
vLLM's check_logprobs_close."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.py"
spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
gpu_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_check)


def test_the_dry_run_runs_every_part_and_writes_the_report(tmp_path):
    result = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(tmp_path)], cwd=ROOT,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    report = json.loads((tmp_path / "report.json").read_text())
    parts = report["parts"]
    assert report["dry_run"] is True and list(parts) == ["kernels", "parity", "kernel_bench", "engine_bench",
                                                         "moe_bench"]
    assert {name: part["status"] for name, part in parts.items()} == dict.fromkeys(parts, "ok")
    kernels = parts["kernels"]["result"]
    assert kernels["tests"] >= 10 and kernels["failures"] == kernels["errors"] == 0
    parity = parts["parity"]["result"]
    for arch in gpu_check.DRY_RUN_ARCHS:
        assert parity[arch]["fp32_close"] == parity[arch]["bf16_close"] == 1.0
    for arch in ("mistral", "qwen2", "opt", "mixtral", "qwen3_moe"):  # the engine's parity tests cover them here
        assert parity[arch] == {"skipped": "not in the dry run"}
    assert parity["triton_preemption"] == {"identical": True, "num_preemptions": parity["triton_preemption"]
                                           ["num_preemptions"]} and parity["triton_preemption"]["num_preemptions"] > 0
    assert parity["triton_prefix_cache"]["identical"] and parity["triton_prefix_cache"]["cached_tokens"] > 0
    assert parity["lora"]["lora_close"] == 1.0 and parity["lora"]["lora_changed"] > 0  # the adapters mattered
    bench = parts["kernel_bench"]["result"]
    assert bench["copy_bytes_per_s"] > 0 and len(bench["decode"]) == 2 and bench["prefill"]["triton_s"] > 0
    assert bench["varlen"]["tokens"] == 31 and bench["varlen"]["triton_s"] > 0
    assert [(row["tile"], row["partition"]) for row in bench["decode_plans"]] == [(16, 0), (16, 32)]
    assert [(row["block_m"], row["tile"], row["stages"]) for row in bench["prefill"]["plans"]] == [(16, 16, None),
                                                                                                  (32, 32, 2)]
    engine = parts["engine_bench"]["result"]
    # the goal's peer only (gpu_check), for kvfleet eager and with CUDA graphs (eager too on the CPU)
    assert set(engine["ratios"]) == {"kvfleet_over_transformers_static", "kvfleet_cuda_graphs_over_transformers_static"}
    assert engine["results"]["kvfleet_cuda_graphs"]["num_decode_steps"] > 0
    assert engine["results"]["kvfleet"]["num_decode_steps"] > 0 and engine["decode_profile"]["median_step_s"] > 0
    assert list(os.listdir(tmp_path)) and len(os.listdir(tmp_path)) <= 8  # what comes back from a GPU machine
    moe = parts["moe_bench"]["result"]
    assert moe["ratios"]["kvfleet_vs_transformers_static"] > 0 and moe["model"]["active_params"] < moe["model"]["params"]
    assert [row["batch"] for row in moe["decode_steps"]] == [1, 4, 16, 32, 64]
    assert moe["weight_bound_until"]["step_tokens"] > 0
    summary = (tmp_path / "summary.txt").read_text()
    assert all(f"{name}: ok" in summary for name in parts)
    assert {p.name for p in tmp_path.iterdir()} == {"report.json", "summary.txt", *(f"{n}.log" for n in parts)}


def test_a_part_that_times_out_loses_nothing_else(tmp_path, monkeypatch):
    monkeypatch.setitem(gpu_check.PARTS, "parity", 1)
    report = gpu_check.drive(tmp_path, True, ["parity", "kernel_bench"])
    assert report["parts"]["parity"]["status"] == "timeout" and report["parts"]["parity"]["result"] is None
    assert report["parts"]["kernel_bench"]["status"] == "ok"
    assert report["parts"]["kernel_bench"]["result"]["decode"]


def test_without_cuda_it_points_at_the_dry_run(tmp_path):
    if torch.cuda.is_available():
        return
    result = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path)], capture_output=True, text=True)
    assert result.returncode == 2 and "--dry-run" in result.stderr


def test_logprobs_close_is_vllms_rule():
    tops = [{1, 2, 3, 4, 5}] * 3
    assert gpu_check.logprobs_close([1, 2, 3], tops, [1, 2, 3], tops) == (True, None)
    assert gpu_check.logprobs_close([1, 2, 3], tops, [1, 4, 9], tops) == (True, 1)  # each in the other's top 5
    assert gpu_check.logprobs_close([1, 2, 3], tops, [1, 7, 3], tops) == (False, 1)
    assert gpu_check.logprobs_close([1, 7], [{1}, {7}], [1, 2], tops) == (False, 1)  # 2 not in the other's top
