"""GGUF weights kept quantized (--quantized-kernels): each kernel type read from its blocks into
codes and scales (engine/quantized_weights.py) as gguf's own dequantizer reads them, the layers
swapped and loaded (engine/quantized_linear.py), and generations against the same file
dequantized at load."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.quantized_linear import QuantizedEmbedding, QuantizedLinear, quantized_bytes
from engine.quantized_weights import KERNEL_TYPES, gguf_quantized_weight
from tests.engine.gguf_files import K_QUANTS, Q, encode, write_gguf
from tests.engine.test_gguf import wide_llama  # noqa: F401 (a fixture)
from tests.engine.test_parity import workload
from tests.engine.test_tensor_parallel import close_or_identical, top5
from tests.kvfleet_kernels.native import native_cpu
from tests.tiny_models import VOCAB

pytestmark = native_cpu
# Q4_K_M's mix: Q4_K queries and MLP, Q6_K values, down projections and head, Q8_0 beside them.
Q4_K_M_LIKE = {"token_embd": Q.Q6_K, "output": Q.Q6_K, "attn_v": Q.Q6_K, "ffn_down": Q.Q6_K, "attn_output": Q.Q8_0}


@pytest.mark.parametrize("qtype", list(KERNEL_TYPES), ids=lambda t: t.name)
def test_every_kernel_type_holds_the_values_ggufs_dequantizer_reads(qtype):
    from gguf.quants import dequantize  # noqa: PLC0415

    rng = np.random.default_rng(int(qtype))
    data = encode(rng.standard_normal((8, 512)).astype(np.float32), qtype, rng)
    expected = dequantize(data, qtype).reshape(8, 512)
    got = gguf_quantized_weight(data, qtype, 512).dequantize().numpy()
    if qtype in K_QUANTS:  # d * sc rounded once to fp16
        assert np.abs(got - expected).max() <= 2 ** -11 * np.abs(expected).max()
    else:
        assert np.array_equal(got, expected)


def assert_within_near_ties(ours, theirs, labels) -> None:
    """Each pair of greedy outputs (with logprobs) within a near-tie of each other (vLLM's close
    rule), the failure naming the request by `labels`."""
    for label, a, b in zip(labels, ours, theirs, strict=True):
        close, _ = close_or_identical(a.token_ids, [top5(e) for e in a.logprobs], b.token_ids,
                                      [top5(e) for e in b.logprobs])
        assert close, f"{label}: quantized and dequantized diverge beyond a near-tie"


def q4_k_m_like(name: str, shape) -> Q:
    return next((qtype for part, qtype in Q4_K_M_LIKE.items() if name.startswith(part) or f".{part}" in name), Q.Q4_K)


@pytest.mark.parametrize("backend", ["auto", "triton"])  # triton: the CUDA path's matmuls, in the interpreter
def test_a_q4_k_m_mix_stays_quantized_in_its_own_bytes_and_generates_as_dequantized(wide_llama, tmp_path,  # noqa: F811
                                                                                      backend):
    written = write_gguf(wide_llama, tmp_path / "model.gguf", q4_k_m_like)
    options = {"skip_tokenizer_init": True, "num_kv_blocks": 256, "attention_backend": backend}
    quantized = LLM(str(tmp_path / "model.gguf"), quantized_kernels=True, **options)
    dequantized = LLM(str(tmp_path / "model.gguf"), quantized_kernels=False, **options)
    model = quantized.engine.model_runner.model
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, QuantizedLinear) and [p.bits for p in qkv.parts] == [4, 4, 6 if backend != "triton" else 8]
    assert isinstance(model.model.embed_tokens, QuantizedEmbedding) and isinstance(model.lm_head, QuantizedLinear)
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert quantized.engine.model_runner.num_params == dequantized.engine.model_runner.num_params
    from gguf import GGML_QUANT_SIZES  # noqa: PLC0415

    kept = [(qtype, tensor.shape) for qtype, tensor in written.values() if qtype in KERNEL_TYPES]
    file_bytes = sum(n * k * GGML_QUANT_SIZES[qtype][1] // GGML_QUANT_SIZES[qtype][0] for qtype, (n, k) in kept)
    # bits a code, features a group, scale bytes a group: Q6_K and Q8_0 are symmetric (b = 32 a, 128 a),
    # so an fp16 a alone; Q4_K keeps its offsets
    layout = {Q.Q4_K: (4, 32, 4), Q.Q6_K: (6, 16, 2), Q.Q8_0: (8, 32, 2)}
    held = sum(-(-n // 16) * 16 * (k * layout[qtype][0] // 8 + k // layout[qtype][1] * layout[qtype][2])
               for qtype, (n, k) in kept)
    assert held <= 1.15 * file_bytes  # Q4_K 5 bits a weight for 4.5, Q6_K 7 for 6.56, Q8_0 8.5 for 8.5
    if backend == "triton":  # codes a byte (two for 4 bits), a scale and an offset a group, no panel padding
        layout = {Q.Q4_K: (4, 32, 4), Q.Q6_K: (8, 16, 4), Q.Q8_0: (8, 32, 4)}
        held = sum(n * (k * layout[qtype][0] // 8 + k // layout[qtype][1] * layout[qtype][2]) for qtype, (n, k) in kept)
    assert quantized_bytes(model) == held
    prompts, params = workload(VOCAB)
    if backend == "triton":  # the interpreter runs each program in Python: four prompts, 8 tokens each
        prompts, params = prompts[2::5], [SamplingParams(temperature=0, max_tokens=8)] * 4
    params = [SamplingParams(**{**vars(p), "logprobs": 5}) for p in params]
    ours = quantized.generate(prompts, params, use_tqdm=False)
    theirs = dequantized.generate(prompts, params, use_tqdm=False)
    # Only the close rule: on this random model even bf16 and fp32 weights part at a near-tie in
    # 12 of the 22 answers, so the count of identical ones says nothing.
    assert_within_near_ties(ours, theirs, [f"prompt {index}" for index in range(len(prompts))])


def test_the_demo_model_answers_from_its_q4_1_weights_kept_quantized():
    """SmolLM2's own Q4_1 file, computed on its 4-bit codes: the tied head shares the table, and
    the 16 chat questions stay within a near-tie of the weights dequantized at load."""
    from engine.models.layers import RMSNorm  # noqa: PLC0415
    from kvfleet_kernels import reference  # noqa: PLC0415
    from kvfleet_kernels.cpu_layers import add_rms_norm, rotary_in_place  # noqa: PLC0415
    from kvfleet_kernels.cpu_quantized_linear import dequantize_weight  # noqa: PLC0415
    from tests.engine.test_real_model import MAX_TOKENS, QUESTIONS, chat_prompts  # noqa: PLC0415

    quantized = LLM("demo", num_kv_blocks=256, quantized_kernels=True)
    dequantized = LLM("demo", num_kv_blocks=256, quantized_kernels=False,
                      dtype=str(quantized.engine.model_runner.dtype).removeprefix("torch."))
    model = quantized.engine.model_runner.model
    assert model.lm_head.parts[0] is model.model.embed_tokens.weight
    # Logits in fp32 whatever the model's dtype: rounded to bf16 they tie at an eighth of a logit,
    # and "The capital" / "L'Étoile" did once this prompt's prefix came from the cache.
    hidden = torch.randn(3, model.lm_head.in_features).to(quantized.engine.model_runner.dtype)
    with torch.inference_mode():
        logits = model.compute_logits(hidden)
    table = model.lm_head.parts[0]
    expected = hidden.float() @ dequantize_weight(table, torch.empty(table.out_features, table.in_features)).T
    assert logits.dtype == torch.float32 and (logits - expected).abs().max() <= 1e-3 * expected.abs().max()
    assert not torch.equal(logits, logits.bfloat16().float())  # not rounded to bf16 on the way
    # The native norm, rotary and SiLU-and-mul around weights kept quantized, in fp32 too; a dense
    # fp32 model keeps torch's ops, which its exact-token tests pin.
    norms = {llm: {m.kernel for m in llm.engine.model_runner.model.modules() if isinstance(m, RMSNorm)}
             for llm in (quantized, dequantized)}
    assert norms[quantized] == {add_rms_norm}
    assert model.model.rotary_emb.fused is rotary_in_place
    if dequantized.engine.model_runner.dtype == torch.float32:
        assert norms[dequantized] == {reference.rms_norm}
    prompts = chat_prompts(quantized.get_tokenizer())
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=5)
    ours = quantized.generate(prompts, params, use_tqdm=False)
    theirs = dequantized.generate(prompts, params, use_tqdm=False)
    assert_within_near_ties(ours, theirs, [repr(question) for question in QUESTIONS])
    assert "Paris" in ours[0].text


def test_lora_adapters_add_beside_weights_kept_quantized(wide_llama, tmp_path):  # noqa: F811
    """Two PEFT adapters (attention only; attention and MLP) and the base model in one batch over a
    Q4_K_M mix kept quantized: each request within a near-tie of the same adapters over the
    weights dequantized at load, and the adapters change what most of their requests answer."""
    from engine import LoRARequest  # noqa: PLC0415
    from tests.lora_adapters import EIGHT, write_adapter  # noqa: PLC0415

    write_gguf(wide_llama, tmp_path / "model.gguf", q4_k_m_like)
    folders = [write_adapter(wide_llama, tmp_path / f"adapter-{i}", EIGHT[i], seed=100 + i, scale=0.3) for i in (1, 3)]
    options = {"skip_tokenizer_init": True, "num_kv_blocks": 256, "enable_lora": True, "max_loras": 2,
               "max_lora_rank": 32}
    quantized = LLM(str(tmp_path / "model.gguf"), quantized_kernels=True, **options)
    dequantized = LLM(str(tmp_path / "model.gguf"), quantized_kernels=False, **options)
    wrapped = quantized.engine.model_runner.lora.layers.values()
    assert wrapped and all(isinstance(layer.base, QuantizedLinear) for layer in wrapped)
    prompts, _ = workload(VOCAB)
    which = [i % 3 - 1 for i in range(len(prompts))]  # -1: the base model
    requests = [None if w < 0 else LoRARequest(f"adapter-{w}", w + 1, str(folders[w])) for w in which]
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=5)
    ours = quantized.generate(prompts, params, use_tqdm=False, lora_request=requests)
    theirs = dequantized.generate(prompts, params, use_tqdm=False, lora_request=requests)
    assert_within_near_ties(ours, theirs, [f"prompt {index} (adapter {w})" for index, w in enumerate(which)])
    base = quantized.generate(prompts, params, use_tqdm=False)
    changed = sum(a.token_ids != b.token_ids for a, b, w in zip(ours, base, which) if w >= 0)
    assert changed >= 0.8 * sum(w >= 0 for w in which), "the adapters barely changed the output"


# A Qwen3-MoE GGUF's experts in three kernel widths: 4-bit gates, 6-bit up projections, 8-bit downs.
MOE_TYPES = {"ffn_gate_inp": Q.F32, "ffn_gate_exps": Q.Q4_0, "ffn_up_exps": Q.Q5_1, "ffn_down_exps": Q.Q8_0,
             "token_embd": Q.Q8_0, "output": Q.Q8_0, "attn": Q.Q4_1}


@pytest.mark.parametrize("architecture", ["qwen3_moe", "mixtral"])  # mixtral: written as a llama with experts
def test_moe_experts_stay_quantized_and_generate_as_dequantized(tiny_tokenizer, tmp_path, architecture, monkeypatch):
    """Each expert's slice of GGUF's stacked expert tensors packed apart (Qwen3-MoE; Mixtral, which
    llama.cpp writes as a llama with experts): the layer's output is the
    expert sum over gguf's own dequantization of the file, the bytes held are the experts' codes and
    scales, the parameter counts (active ones too) are the dequantized load's, and greedy answers stay
    within a near-tie of that load's. At a few rows an expert (decode) every expert's matmuls run as
    one grouped call each, with the rows an expert at a time computes."""
    from engine.demo_model import write_checkpoint  # noqa: PLC0415
    from engine.quantized_experts import quantized_expert_linear  # noqa: PLC0415
    from engine.quantized_linear import AMX_ROWS, QuantizedExperts, integer_rows_below  # noqa: PLC0415
    from kvfleet_kernels import cpu_quantized_linear, reference  # noqa: PLC0415
    from tests.engine.test_gguf import GGUF_CONFIGS  # noqa: PLC0415
    from tests.tiny_models import TINY_CONFIGS  # noqa: PLC0415

    config = (GGUF_CONFIGS | {"mixtral": TINY_CONFIGS["mixtral"]})[architecture]()
    hf_dir = write_checkpoint(config, tmp_path / "hf", seed=3, tokenizer=tiny_tokenizer)
    written = write_gguf(hf_dir, tmp_path / "model.gguf",
                         lambda name, shape: next(t for part, t in MOE_TYPES.items() if name.startswith(part)
                                                  or f".{part}" in name))
    options = {"skip_tokenizer_init": True, "num_kv_blocks": 256}
    quantized = LLM(str(tmp_path / "model.gguf"), quantized_kernels=True, **options)
    dequantized = LLM(str(tmp_path / "model.gguf"), quantized_kernels=False, **options)
    runner, dense_runner = quantized.engine.model_runner, dequantized.engine.model_runner
    layers = runner.model.model.layers
    for index, layer in enumerate(layers):
        experts = layer.mlp.experts.quantized
        assert isinstance(experts, QuantizedExperts) and layer.mlp.experts.w13_weight is None
        assert [[p.bits for p in linear.parts] for linear in experts.w13] == [[4, 6]] * 8
        assert [[p.bits for p in linear.parts] for linear in experts.w2] == [[8]] * 8
        w13 = np.concatenate([written[f"blk.{index}.ffn_{p}_exps.weight"][1] for p in ("gate", "up")], axis=1)
        w2 = written[f"blk.{index}.ffn_down_exps.weight"][1]
        for rows in (3, 200):  # the integer products; AMX tiles or the dense path for an expert's many rows
            hidden = torch.randn(rows, config.hidden_size, generator=torch.Generator().manual_seed(rows))
            grouped = []
            monkeypatch.setattr(cpu_quantized_linear, "linear_grouped", lambda *args, seen=grouped,
                                call=cpu_quantized_linear.linear_grouped: seen.append(len(args[1]) - 1) or call(*args))
            with torch.inference_mode():
                weights, ids = layer.mlp.gate(hidden)
                expected = reference.fused_moe(hidden, torch.from_numpy(w13), torch.from_numpy(w2), weights, ids)
                got = layer.mlp.experts(hidden, weights, ids)
                one_at_a_time = reference.fused_moe(hidden, experts.w13, experts.w2, weights, ids,
                                                    linear=quantized_expert_linear)
            monkeypatch.undo()
            # grouped (gate_up, then down, over every routed expert) while each expert's rows take the
            # integer path: 3 rows everywhere, 200 where no expert gets AMX_ROWS on an AMX host
            routed, most = len(ids.unique()), int(torch.bincount(ids.flatten()).max())
            assert grouped == ([routed, routed] if most < integer_rows_below() else []), rows
            if grouped:
                assert torch.equal(got, one_at_a_time)
            # AMX tiles multiply x and the weight rounded to bf16 (csrc/quantized_linear_amx.cpp): bf16's
            # precision, 4 units of its roundoff; the integer products keep ~1e-3 (int16 activations)
            amx = rows >= AMX_ROWS and cpu_quantized_linear.amx_available()
            bound = (2**-7 if amx else 1e-3) * expected.abs().max()
            assert (got - expected).abs().max() <= bound, (index, rows)
    # per expert, groups of 32: gate (I x H, 4 bits, a) and up (6 bits, a and b), down (H x I, 8 bits, a)
    width, size = getattr(config, "moe_intermediate_size", config.intermediate_size), config.hidden_size
    expert_bytes = width * (size // 2 + size // 32 * 2) + width * (size * 6 // 8 + size // 32 * 4) \
        + size * (width + width // 32 * 2)
    assert sum(linear.nbytes for layer in layers for linear in [*layer.mlp.experts.quantized.w13,
                                                                 *layer.mlp.experts.quantized.w2]) \
        == len(layers) * 8 * expert_bytes
    assert (runner.num_params, runner.num_active_params) == (dense_runner.num_params, dense_runner.num_active_params)
    prompts, params = workload(VOCAB)
    params = [SamplingParams(**{**vars(p), "logprobs": 5}) for p in params]
    ours = quantized.generate(prompts, params, use_tqdm=False)
    theirs = dequantized.generate(prompts, params, use_tqdm=False)
    assert_within_near_ties(ours, theirs, [f"{architecture} prompt {index}" for index in range(len(prompts))])


def test_steps_of_many_rows_dequantize_each_part_a_slice_at_a_time(monkeypatch):
    # The dense path (steps of DENSE_ROWS rows or more) dequantizes each part in slices of
    # DENSE_CHUNK_BYTES; 3 panels a slice here cut a 100-column part into 3 + 3 + 1 panels (the last
    # of 4 columns) and a 48-column one, its inputs reordered as GPTQ's desc_act has them, into 3.
    import torch.nn.functional as F  # noqa: PLC0415, N812

    from engine import quantized_linear  # noqa: PLC0415
    from kvfleet_kernels import cpu_quantized_linear as kernels  # noqa: PLC0415
    from tests.kvfleet_kernels.test_cpu_quantized_linear import random_weight  # noqa: PLC0415

    generator = torch.Generator().manual_seed(5)
    k = 64
    weights = [random_weight(4, 32, 100, k, generator), random_weight(8, 16, 48, k, generator)]
    weights[1].input_order = torch.randperm(k, generator=generator)
    layer = QuantizedLinear(k, [100, 48], torch.nn.Parameter(torch.randn(148, generator=generator)))
    for part, weight in enumerate(weights):
        layer.load_part(part, weight)
    monkeypatch.setattr(quantized_linear, "DENSE_CHUNK_BYTES", 3 * 16 * k * 4)
    sliced = []
    monkeypatch.setattr(kernels, "dequantize_weight", lambda weight, out, whole=kernels.dequantize_weight:
                        sliced.append(weight.out_features) or whole(weight, out))
    x = torch.randn(max(quantized_linear.DENSE_ROWS, quantized_linear.AMX_DENSE_ROWS), k, generator=generator)
    expected = F.linear(x.double(), torch.cat([w.dequantize() for w in weights]).double(), layer.bias.double())
    torch.testing.assert_close(layer(x).double(), expected, rtol=1e-5, atol=1e-5)
    assert sliced == [48, 48, 4, 48]
