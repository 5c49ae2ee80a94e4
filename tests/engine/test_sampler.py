"""Sampling: seeds, support restriction, stop strings, penalties, logprobs."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams
from engine.sampler import Sampler, SamplerRow, apply_penalties, filter_probs, first_argmax
from engine.sequence import Sequence
from kvfleet_kernels.cpu_paged_attention import load_error


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, num_kv_blocks=256)


def row(params: SamplingParams, prompt=(5,), output=(), seed_generator: int | None = None) -> SamplerRow:
    seq = Sequence("r", list(prompt), params)
    seq.token_ids.extend(output)
    generator = None if seed_generator is None else torch.Generator().manual_seed(seed_generator)
    return SamplerRow(seq, generator, [])


def test_seeded_request_is_reproducible_in_any_batch_mix(llm):
    seeded = SamplingParams(temperature=1.0, seed=42, max_tokens=24)
    alone = llm.generate([[10, 20, 30]], seeded, use_tqdm=False)[0].token_ids
    others = [[7] * 50, [8, 9], [11] * 130]
    mixed = llm.generate(others[:2] + [[10, 20, 30]] + others[2:],
                         [SamplingParams(temperature=1.0, max_tokens=30), SamplingParams(temperature=0.7, seed=1),
                          seeded, SamplingParams(temperature=1.3, max_tokens=5)], use_tqdm=False)
    assert mixed[2].token_ids == alone
    reordered = llm.generate([[10, 20, 30], [3] * 40], [seeded, SamplingParams(temperature=1.0, seed=7)],
                             use_tqdm=False)
    assert reordered[0].token_ids == alone
    other_seed = llm.generate([[10, 20, 30]], SamplingParams(temperature=1.0, seed=43, max_tokens=24),
                              use_tqdm=False)[0].token_ids
    assert other_seed != alone


def test_filters_keep_exactly_the_allowed_support():
    probs = torch.tensor([[0.05, 0.4, 0.1, 0.3, 0.15]])
    keep = lambda **kw: filter_probs(probs, [row(SamplingParams(**kw))])[0].nonzero().flatten().tolist()
    assert keep(top_k=2) == [1, 3]
    assert keep(top_p=0.5) == [1, 3]  # 0.4 alone is below 0.5, so 0.3 joins
    assert keep(top_p=0.4) == [1]
    assert keep(top_p=0.86) == [1, 2, 3, 4]
    assert keep(min_p=0.5) == [1, 3]  # floor 0.5 * 0.4 = 0.2
    assert keep(min_p=0.3, top_k=3) == [1, 3, 4]
    assert keep() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("options, support", [({"top_k": 2}, {1, 3}), ({"top_p": 0.5}, {1, 3}),
                                              ({"min_p": 0.3}, {1, 3, 4})])
def test_sampling_draws_only_from_the_support_and_covers_it(options, support):
    logits = torch.log(torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15]))[None, :].repeat(400, 1)
    rows = [row(SamplingParams(temperature=1.0, **options), seed_generator=i) for i in range(400)]
    drawn = set(Sampler()(logits, rows).token_ids)
    assert drawn == support


def test_temperature_zero_is_argmax_and_sampling_follows_the_distribution():
    logits = torch.tensor([[0.0, 2.0, 1.0]])
    assert Sampler()(logits, [row(SamplingParams(temperature=0))]).token_ids == [1]
    rows = [row(SamplingParams(temperature=1.0), seed_generator=i) for i in range(4000)]
    drawn = torch.tensor(Sampler()(logits.repeat(4000, 1), rows).token_ids)
    frequencies = torch.bincount(drawn, minlength=3).float() / 4000
    assert torch.allclose(frequencies, torch.softmax(logits[0], -1), atol=0.03)


def test_greedy_ties_go_to_the_first_index_as_argmax():
    # Ties placed across a 32k row (the vectorised and threaded reduction paths) and in a row
    # that suppression left all -inf but two.
    logits = torch.randn(64, 32000)
    for row in range(64):
        logits[row, [31999 - row * 7, 100 + row, 20000 - row]] = 50.0
    logits[5] = float("-inf")
    logits[5, [900, 30]] = 1.0
    assert torch.equal(first_argmax(logits), logits.argmax(dim=-1))
    assert first_argmax(logits)[5].item() == 30


@pytest.mark.skipif(load_error() is not None, reason="no C++ compiler: the native kernels cannot build")
def test_bf16_greedy_rows_pick_what_the_fp32_copy_would_and_other_rows_still_get_fp32():
    from kvfleet_kernels.cpu_layers import argmax_rows  # noqa: PLC0415 (the native CPU backend's argmax)

    logits = (torch.randn(6, 3000, generator=torch.Generator().manual_seed(0)) * 4).to(torch.bfloat16)
    logits[1, [17, 2900]] = 40.0  # a tie: the first index
    seen: list[torch.dtype] = []

    def recording_argmax(values):
        seen.append(values.dtype)
        return argmax_rows(values)

    greedy = [row(SamplingParams(temperature=0)) for _ in range(6)]
    greedy[2] = SamplerRow(greedy[2].seq, None, [int(logits[2].float().argmax())])  # below min_tokens: suppressed
    out = Sampler(recording_argmax)(logits, greedy)
    expected = logits.float().clone()
    expected[2, greedy[2].suppressed_token_ids] = float("-inf")
    assert out.token_ids == expected.argmax(dim=-1).tolist() and out.token_ids[1] == 17
    assert seen == [torch.bfloat16]  # read as they are: no fp32 copy
    with_logprobs = greedy[:5] + [row(SamplingParams(temperature=0, logprobs=2))]
    out = Sampler(recording_argmax)(logits, with_logprobs)
    assert seen[-1] == torch.float32 and out.token_ids == expected.argmax(dim=-1).tolist()
    assert out.logprobs[5][out.token_ids[5]] == pytest.approx(
        torch.log_softmax(logits[5].float(), -1)[out.token_ids[5]].item())


def test_penalties_match_their_formulas():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    params = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    prompt, output = [0, 4], [3, 3, 1]
    got = apply_penalties(logits.clone(), [row(params, prompt, output)])[0]
    expected = logits[0].clone()
    for token in set(prompt + output):  # repetition: over prompt and output
        expected[token] = expected[token] / 2.0 if expected[token] > 0 else expected[token] * 2.0
    counts = {3: 2, 1: 1}  # presence and frequency: over the output only
    for token, count in counts.items():
        expected[token] -= 0.5 + 0.25 * count
    assert torch.allclose(got, expected)
    assert got.tolist() == pytest.approx([1.0, -2.75, 0.5, 0.5, -4.0])


def test_min_tokens_holds_back_stop_tokens_until_reached(llm):
    every_token_but_one = [t for t in range(512) if t != 77]  # 77 is the only way to keep going
    plain = llm.generate([[10, 20, 30]], SamplingParams(temperature=0, max_tokens=12,
                                                        stop_token_ids=every_token_but_one), use_tqdm=False)[0]
    assert len(plain.token_ids) == 1 and plain.finish_reason == "stop"
    held = llm.generate([[10, 20, 30]], SamplingParams(temperature=0, max_tokens=12, min_tokens=6,
                                                       stop_token_ids=every_token_but_one), use_tqdm=False)[0]
    # Stop ids (and EOS) are masked for the first 6 tokens, so only 77 can be drawn.
    assert held.token_ids[:6] == [77] * 6
    assert len(held.token_ids) == 7 and held.finish_reason == "stop"


def test_stop_string_cuts_the_text_and_reports_stop(llm):
    prompt = "The fleet wakes"
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0]
    assert free.finish_reason == "length"
    text = free.text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert len(stop) == 3
    stopped = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, stop=[stop, "\x00never"]),
                           use_tqdm=False)[0]
    assert stopped.finish_reason == "stop"
    assert stopped.outputs[0].stop_reason == stop
    assert stopped.text == text[: text.index(stop)]
    assert stopped.token_ids == free.token_ids[: len(stopped.token_ids)]
    assert len(stopped.token_ids) < len(free.token_ids)


def test_logprobs_equal_log_softmax_of_the_reference_logits(llm, tiny_llama):
    prompt = [1, 40, 41, 42, 43, 44]
    output = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, logprobs=3), use_tqdm=False)[0]
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + output.token_ids])).logits[0]
    reference = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)  # [6, vocab]
    assert len(output.logprobs) == 6
    for step, (token, entry) in enumerate(zip(output.token_ids, output.logprobs)):
        assert next(iter(entry)) == token  # the sampled token comes first
        top_values, top_ids = reference[step].topk(3)
        assert set(entry) == set(top_ids.tolist()) | {token}
        for token_id, value in entry.items():
            assert value == pytest.approx(reference[step, token_id].item(), abs=1e-4)
