"""Mixture of experts: each model's router against transformers' (exact ids and
weights, ties included), the experts' torch path against transformers' experts, a
cached prefix and the Triton path end to end, parameter counts, and configurations
that cannot run."""

from __future__ import annotations

import json
import random

import pytest
import torch
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts, GptOssTopKRouter
from transformers.models.mixtral.modeling_mixtral import MixtralExperts, MixtralTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from engine import LLM, SamplingParams
from engine.demo_model import write_checkpoint
from engine.models import layers, moe
from engine.models.gpt_oss import GptOssMLP, deinterleave
from engine.models.mixtral import MixtralDecoderLayer
from engine.models.moe import FusedMoE
from engine.models.qwen3_moe import Qwen3MoeDecoderLayer
from kvfleet_kernels import cpu_linear, reference
from tests.engine.test_parity import reference_outputs
from tests.tiny_models import TINY_CONFIGS

HIDDEN, EXPERTS = 64, 8


def hidden_states(num_tokens: int = 200, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(seed))


def tied_weight(seed: int) -> torch.Tensor:
    """[E, H] router weight whose experts 1, 4 and 6 are the same row: three logits tie on every token."""
    weight = torch.randn(EXPERTS, HIDDEN, generator=torch.Generator().manual_seed(seed)) * 0.2
    weight[4] = weight[1]
    weight[6] = weight[1]
    return weight


def ours_and_theirs(name: str, top_k: int, **config_overrides):
    config = TINY_CONFIGS[name]()
    config.num_experts_per_tok = top_k
    for key, value in config_overrides.items():
        setattr(config, key, value)
    # Ours as each model builds it, so the test holds the models' own rules.
    if name == "mixtral":
        theirs, ours = MixtralTopKRouter(config), MixtralDecoderLayer.make_mlp(None, config, 0).gate
    elif name == "qwen3_moe":
        theirs, ours = Qwen3MoeTopKRouter(config), Qwen3MoeDecoderLayer.make_mlp(None, config, 0).gate
    else:
        theirs, ours = GptOssTopKRouter(config), GptOssMLP(config).router
    with torch.no_grad():
        theirs.weight.copy_(tied_weight(top_k))
        ours.weight.copy_(theirs.weight)
        if ours.bias is not None:
            theirs.bias.copy_(torch.linspace(-0.3, 0.3, EXPERTS))
            theirs.bias[4] = theirs.bias[6] = theirs.bias[1]  # keep the tie
            ours.bias.copy_(theirs.bias)
    return ours, theirs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name, top_k, overrides", [
    ("mixtral", 2, {}), ("qwen3_moe", 4, {"norm_topk_prob": True}), ("qwen3_moe", 2, {"norm_topk_prob": False}),
    ("gpt_oss", 2, {}), ("gpt_oss", 4, {})])
def test_router_matches_transformers_exactly_with_ties(name, top_k, overrides, dtype):
    ours, theirs = ours_and_theirs(name, top_k, **overrides)
    ours, theirs = ours.to(dtype), theirs.to(dtype)
    hidden = hidden_states().to(dtype)
    with torch.no_grad():
        weights, ids = ours(hidden)
        _, their_weights, their_ids = theirs(hidden)
    assert torch.equal(ids, their_ids)
    assert weights.dtype == their_weights.dtype and torch.equal(weights, their_weights)
    assert weights.shape == ids.shape == (200, top_k)
    tied = {1, 4, 6}
    chose_tied = [set(row) & tied for row in ids.tolist()]
    assert sum(len(chosen) >= 2 for chosen in chose_tied) > 10  # the ties were really picked between
    if name != "qwen3_moe" or overrides.get("norm_topk_prob"):
        tolerance = 1e-6 if weights.dtype == torch.float32 else 1e-2
        torch.testing.assert_close(weights.sum(-1).float(), torch.ones(200), atol=tolerance, rtol=0)


def random_experts(num_experts: int, hidden: int, intermediate: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * intermediate, hidden, generator=generator) * 0.2
    w2 = torch.randn(num_experts, hidden, intermediate, generator=generator) * 0.2
    return w13, w2


def test_torch_experts_match_mixtral_experts():
    config = TINY_CONFIGS["mixtral"]()
    theirs = MixtralExperts(config)
    w13, w2 = random_experts(EXPERTS, HIDDEN, config.intermediate_size, seed=1)
    with torch.no_grad():
        theirs.gate_up_proj.copy_(w13)  # transformers stacks Mixtral's experts the same way
        theirs.down_proj.copy_(w2)
        hidden = hidden_states(37)
        weights, ids = torch.topk(torch.rand(37, EXPERTS, generator=torch.Generator().manual_seed(3)).softmax(-1), 2)
        expected = theirs(hidden, ids, weights)
    # The same rows per expert in another order: a GEMM may round a row differently by its neighbours.
    torch.testing.assert_close(reference.fused_moe(hidden, w13, w2, weights, ids), expected, rtol=1e-5, atol=1e-6)


def test_torch_experts_match_gpt_oss_experts_with_biases_and_clamps():
    config = TINY_CONFIGS["gpt_oss"]()
    theirs = GptOssExperts(config)
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for param in theirs.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
        hidden = hidden_states(29) * 3  # large enough that both clamps cut
        weights, ids = torch.topk(torch.rand(29, EXPERTS, generator=torch.Generator().manual_seed(4)).softmax(-1), 2)
        expected = theirs(hidden, ids, weights)
        gate, up = deinterleave(theirs.gate_up_proj)  # [E, H, I] each
        bias_gate, bias_up = deinterleave(theirs.gate_up_proj_bias)
        got = reference.fused_moe(hidden, torch.cat([gate, up], 2).transpose(1, 2), theirs.down_proj.transpose(1, 2), weights, ids,
                                  "swigluoai", torch.cat([bias_gate, bias_up], 1), theirs.down_proj_bias,
                                  swiglu_alpha=config.swiglu_alpha, swiglu_limit=config.swiglu_limit)
        gate_up = hidden @ theirs.gate_up_proj[0]
        assert (gate_up[:, 0::2] > config.swiglu_limit).any() and (gate_up[:, 1::2].abs() > config.swiglu_limit).any()
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "gpt_oss"])
def test_a_cached_prefix_gives_transformers_tokens(tiny_models, name):
    rng = random.Random(11)
    shared = [rng.randrange(3, 512) for _ in range(96)]  # six blocks, twice gpt-oss's window of 48
    prompts = [shared + [rng.randrange(3, 512) for _ in range(n)] for n in (3, 17, 40)]
    params = [SamplingParams(temperature=0, max_tokens=24)] * 3
    llm = LLM(tiny_models[name], num_kv_blocks=128)
    outputs = [llm.generate([prompt], param, use_tqdm=False)[0] for prompt, param in zip(prompts, params)]
    assert [o.num_cached_tokens for o in outputs] == [0, 96, 96]
    assert [o.token_ids for o in outputs] == reference_outputs(tiny_models[name], prompts, params)


@pytest.mark.parametrize("name", ["gpt_oss"])  # experts with biases, sinks, windows: every MoE-model kernel path
def test_triton_path_matches_the_torch_path_with_preemption(tiny_models, name):
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (1, 16, 33, 60, 90)]
    params = SamplingParams(temperature=0, max_tokens=12)
    outputs = {}
    for backend in ("torch", "triton"):
        llm = LLM(tiny_models[name], num_kv_blocks=10, attention_backend=backend)
        experts = [m for m in llm.engine.model_runner.model.modules() if isinstance(m, FusedMoE)]
        assert experts and all((m.kernel is reference.fused_moe) == (backend == "torch") for m in experts)
        outputs[backend] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert llm.engine.scheduler.num_preemptions > 0
    assert outputs["triton"] == outputs["torch"]


@pytest.mark.parametrize("name, total, active", [
    # Embeddings, attention and norms, plus the experts: 2 layers x 8 experts x 3 x 64 x 96, a quarter active.
    ("mixtral", 2 * 512 * 64 + 2 * (64 * 64 * 2 + 64 * 32 * 2 + 2 * 64 + 8 * 64) + 64 + 2 * 8 * 3 * 64 * 96,
     2 * 512 * 64 + 2 * (64 * 64 * 2 + 64 * 32 * 2 + 2 * 64 + 8 * 64) + 64 + 2 * 2 * 3 * 64 * 96)])
def test_parameter_counts(tiny_models, name, total, active):
    runner = LLM(tiny_models[name], num_kv_blocks=16, onednn_linear=False).engine.model_runner
    assert (runner.num_params, runner.num_active_params) == (total, active)
    assert runner.num_params == sum(p.numel() for p in runner.model.parameters())


def test_dense_models_count_every_parameter_active(tiny_models):
    runner = LLM(tiny_models["llama"], num_kv_blocks=16, onednn_linear=False).engine.model_runner
    assert runner.num_params == runner.num_active_params == sum(p.numel() for p in runner.model.parameters())


@pytest.mark.parametrize("change, message", [
    ({"num_experts_per_tok": 9}, r"num_experts_per_tok 9 must be in \[1, 8\]"),
    ({"hidden_act": "gelu"}, "MoE activation 'gelu' is not supported"),
])
def test_configurations_that_cannot_run_are_clear_errors(tmp_path, tiny_tokenizer, change, message):
    model_dir = write_checkpoint(TINY_CONFIGS["mixtral"](), tmp_path / "mixtral", tokenizer=tiny_tokenizer)
    config_file = model_dir / "config.json"
    data = json.loads(config_file.read_text())
    data.update(change)
    config_file.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=message):
        LLM(str(model_dir), num_kv_blocks=16)


@pytest.mark.parametrize("kernel", [None, "vnni", "brgemm"])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_experts_packed_for_the_cpu_keep_the_expert_sum(monkeypatch, kernel, bias):
    """pack_for_onednn on bf16 experts: each expert's w13 and w2 go to the CPU's packed bf16
    kernel (or, without one, to oneDNN's layout), and the expert sum stays the torch path's
    within bf16 rounding (both round each matmul's fp32 sums once)."""
    if kernel and not cpu_linear.available(kernel):
        pytest.skip(f"no {kernel} bf16 linears on this CPU")
    if not kernel and not layers.onednn_bf16_supported():
        pytest.skip("oneDNN has no bf16 matmul on this CPU")
    monkeypatch.setattr(cpu_linear, "preferred_kernel", lambda: kernel)
    generator = torch.Generator().manual_seed(7)
    experts = FusedMoE(8, 64, 96, "silu", bias=bias).bfloat16()
    with torch.no_grad():
        for param in experts.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    hidden = torch.randn(37, 64, generator=generator).bfloat16()
    topk_ids = torch.randint(0, 8, (37, 2), generator=generator)
    topk_weights = torch.rand(37, 2, generator=generator).softmax(-1)
    expected = experts(hidden, topk_weights, topk_ids)
    experts.pack_for_onednn(batch_size_hint=64)
    assert experts.w13_weight is None and len(experts.packed[0]) == len(experts.packed[1]) == 8
    assert experts.linear is (moe.packed_expert_linear if kernel else layers.onednn_linear)
    assert all(getattr(w, "kernel", None) == kernel for w in experts.packed[0] + experts.packed[1])
    got = experts(hidden, topk_weights, topk_ids)
    torch.testing.assert_close(got, expected, rtol=2**-6, atol=2e-2)
