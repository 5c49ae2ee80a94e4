"""dtype auto: bf16 on CPUs that multiply bf16 natively, fp32 elsewhere and under the
Triton interpreter, the checkpoint's dtype on CUDA; an explicit dtype is always kept."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from engine import LLM, model_runner
from engine.model_runner import resolve_dtype
from engine.models.layers import onednn_bf16_supported

CPU = torch.device("cpu")


@pytest.mark.parametrize(("native_bf16", "backend", "expected"), [
    (True, "auto", torch.bfloat16), (True, "cpu", torch.bfloat16), (True, "triton", torch.float32),
    (False, "auto", torch.float32)])
def test_auto_on_the_cpu(monkeypatch, caplog, native_bf16, backend, expected):
    monkeypatch.setattr(model_runner, "cpu_has_native_bf16", lambda: native_bf16)
    with caplog.at_level(logging.INFO, logger="engine.model_runner"):
        assert resolve_dtype("auto", SimpleNamespace(dtype="float16"), CPU, backend) == expected
    assert f"dtype auto: {str(expected).removeprefix('torch.')}" in caplog.text


def test_explicit_dtype_and_cuda_keep_what_they_name(monkeypatch):
    monkeypatch.setattr(model_runner, "cpu_has_native_bf16", lambda: True)
    assert resolve_dtype("float32", SimpleNamespace(), CPU) == torch.float32
    assert resolve_dtype("float16", SimpleNamespace(), CPU) == torch.float16
    assert resolve_dtype("auto", SimpleNamespace(dtype="bfloat16"), torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("auto", SimpleNamespace(), torch.device("cuda")) == torch.float32


def test_auto_engine_runs_bf16_end_to_end_on_a_bf16_cpu(monkeypatch, tiny_llama):
    monkeypatch.setattr(model_runner, "cpu_has_native_bf16", lambda: True)
    runner = LLM(tiny_llama, num_kv_blocks=32).engine.model_runner
    assert runner.dtype == torch.bfloat16
    assert runner.kv_caches[0][0].dtype == torch.bfloat16
    packed = [m for m in runner.model.modules() if type(m).__name__ in ("OneDNNLinear", "PackedBf16Linear")]
    if onednn_bf16_supported():  # oneDNN packs bf16 weights once
        assert packed and all(m.packed_weight.dtype == torch.bfloat16 for m in packed)
    else:  # a CPU oneDNN has no bf16 matmul for (AVX2 only): torch's own linears, nothing packed
        assert not packed
