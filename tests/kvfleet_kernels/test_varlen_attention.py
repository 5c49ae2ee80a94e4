"""The packed (varlen) attention of embedding models: the Triton kernel (interpreter on
the CPU) and the padded-SDPA CPU path against the per-sequence reference, and the
embedding engine end to end on the Triton path against the torch path."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from engine import EngineConfig, create_engine
from engine.models.layers import bucket_rows
from engine.packed_attention import PackedAttentionMetadata
from kvfleet_kernels import reference
from kvfleet_kernels.cpu_paged_attention import load_error
from kvfleet_kernels.cpu_varlen_attention import varlen_attention as cpu_varlen_attention
from kvfleet_kernels.varlen_attention import varlen_attention
from tests.embedding_models import write_embedding_checkpoint
from tests.kvfleet_kernels.native import native_cpu

TOLERANCE = 1e-4


def packed(seq_lens, num_heads, num_kv_heads, head_dim, seed=0):
    generator = torch.Generator().manual_seed(seed)
    total = sum(seq_lens)
    return [torch.randn(total, heads, head_dim, generator=generator, device="cpu").to(torch.get_default_device())
            for heads in (num_heads, num_kv_heads, num_kv_heads)]


@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("head_dim", [32, 48, 64])  # 48: padded inside the kernel only
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seq_lens", [[1], [17], [16, 16, 16], [1, 7, 33, 64, 70, 2]])
def test_varlen_attention_matches_reference(num_heads, num_kv_heads, head_dim, causal, seq_lens):
    query, key, value = packed(seq_lens, num_heads, num_kv_heads, head_dim)
    scale = 1 / math.sqrt(head_dim)
    expected = reference.varlen_attention(query, key, value, seq_lens, scale, causal)
    meta = PackedAttentionMetadata.build(seq_lens, causal, query.device)
    got = varlen_attention(query, key, value, meta.cu_seqlens, meta.max_seqlen, scale, causal)
    assert (got - expected).abs().max() <= TOLERANCE
    padded = reference.padded_varlen_attention(query, key, value, seq_lens, scale, causal)
    assert (padded - expected).abs().max() <= TOLERANCE
    if query.device.type == "cpu" and load_error() is None:
        native = cpu_varlen_attention(query, key, value, meta.cu_seqlens, scale, causal)
        assert (native - expected).abs().max() <= TOLERANCE


@native_cpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
def test_native_cpu_kernel_reads_a_fused_projection_in_low_precision(dtype, causal):
    """q/k/v as views of one [T, 3, H, D] projection (row stride 3*H*D), as bert.py passes them,
    with pad rows after the last input: fp32 accumulation, one rounding of the output, and
    zero on the pad rows."""
    seq_lens, num_heads, head_dim = [3, 60, 1, 129, 16], 12, 32
    total, padded_rows = sum(seq_lens), sum(seq_lens) + 11
    qkv = torch.randn(padded_rows, 3, num_heads, head_dim, generator=torch.Generator().manual_seed(7), device="cpu").to(dtype)
    query, key, value = qkv.unbind(1)
    meta = PackedAttentionMetadata.build(seq_lens, causal, query.device, padded_rows)
    got = cpu_varlen_attention(query, key, value, meta.cu_seqlens, 0.2, causal)
    assert got.shape == query.shape and got.dtype == dtype
    expected = reference.varlen_attention(*(x[:total].float() for x in (query, key, value)), seq_lens, 0.2, causal)
    # One rounding to the dtype (half an ulp: 2^-9 relative in bf16, 2^-12 in fp16) on fp32 sums.
    rtol = 2 ** -8 if dtype == torch.bfloat16 else 2 ** -11
    torch.testing.assert_close(got[:total].float(), expected, rtol=rtol, atol=1e-5)
    assert not got[total:].any()
    assert meta.seq_lens.tolist() == [n for n in seq_lens for _ in range(n)] + [1] * 11


def test_each_sequence_sees_only_itself():
    """Changing one sequence's keys leaves every other sequence's output exactly alone."""
    seq_lens = [5, 9, 3]
    query, key, value = packed(seq_lens, 2, 2, 32, seed=1)
    meta = PackedAttentionMetadata.build(seq_lens, False, query.device)
    before = varlen_attention(query, key, value, meta.cu_seqlens, meta.max_seqlen, 0.2, False)
    key[5:14] += 3.0  # the second sequence
    after = varlen_attention(query, key, value, meta.cu_seqlens, meta.max_seqlen, 0.2, False)
    assert torch.equal(before[:5], after[:5]) and torch.equal(before[14:], after[14:])
    assert not torch.allclose(before[5:14], after[5:14])


@pytest.mark.parametrize("name, extra", [("xlm_roberta", {}), ("qwen3_embedding", {"pooling": "last"}),
                                         ("bert", {"dtype": "bfloat16"})])
def test_embedding_engine_on_triton_and_native_cpu_matches_torch(tmp_path, tiny_tokenizer, name, extra):
    """The same embeddings from the torch path, the Triton kernel and the native CPU kernel (the
    CPU default, with the batch padded to the matmuls' row buckets; in bf16, with the native
    LayerNorms too)."""
    folder = str(write_embedding_checkpoint(name, tmp_path / name, tiny_tokenizer))
    generator = torch.Generator().manual_seed(3)
    inputs = [torch.randint(3, 500, (n,), generator=generator, device="cpu").tolist() for n in (1, 9, 40, 64, 17, 70)]
    results, on_cuda = {}, torch.get_default_device().type == "cuda"  # under scripts/gpu_check.py
    backends = ("torch", "auto") if extra.get("dtype") == "bfloat16" else ("torch", "triton", "auto")
    for backend in backends:
        engine = create_engine(EngineConfig(model=folder, attention_backend=backend, task="embed", **extra))
        auto = "triton" if on_cuda else "cpu"
        assert engine.model_runner.backend.name == {"auto": auto}.get(backend, backend)
        engine.add_request("r", inputs)
        (output,) = engine.step()
        results[backend] = torch.tensor([o.embedding for o in output.outputs])
    padded = sum(map(len, inputs)) != bucket_rows(sum(map(len, inputs)))
    assert on_cuda or (engine.model_runner.pad_rows and padded)
    for backend in backends[1:]:
        assert F.cosine_similarity(results[backend], results["torch"]).min() >= 0.99999
