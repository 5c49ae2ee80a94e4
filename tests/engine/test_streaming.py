"""DELTA outputs (streaming): concatenated, each sample's deltas equal the FINAL_ONLY
output of the same request, token for token and character for character."""

import dataclasses

import pytest

from engine import LLM, RequestOutputKind, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, num_kv_blocks=128, max_num_seqs=8)


def stream(llm, prompt: str, params: SamplingParams):
    """Run one DELTA request; return {index: (text, token_ids, logprobs, finish_reasons)} and the outputs."""
    engine = llm.engine
    engine.add_request("streamed", prompt, dataclasses.replace(params, output_kind=RequestOutputKind.DELTA))
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    samples: dict[int, tuple] = {}
    for output in outputs:
        for delta in output.outputs:
            text, ids, logprobs, reasons = samples.get(delta.index, ("", [], [], []))
            samples[delta.index] = (text + delta.text, ids + delta.token_ids, logprobs + (delta.logprobs or []),
                                    reasons + [delta.finish_reason])
    return samples, outputs


CASES = {
    "greedy": SamplingParams(temperature=0, max_tokens=24),
    "n=2 seeded": SamplingParams(temperature=1.0, seed=7, n=2, max_tokens=12),
    "logprobs": SamplingParams(temperature=0, max_tokens=8, logprobs=2),
}


@pytest.mark.parametrize("name", list(CASES))
def test_deltas_add_up_to_the_final_output(llm, name):
    params = CASES[name]
    final = llm.generate(["the cat sat on"], params, use_tqdm=False)[0]
    samples, outputs = stream(llm, "the cat sat on", params)
    assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
    assert len(outputs) > 2  # it really streamed
    assert sorted(samples) == list(range(params.n))
    for completion in final.outputs:
        text, ids, logprobs, reasons = samples[completion.index]
        assert (text, ids) == (completion.text, completion.token_ids)
        assert reasons[-1] == completion.finish_reason and set(reasons[:-1]) <= {None}
        if params.logprobs is not None:
            assert logprobs == completion.logprobs


def test_a_stop_string_is_never_streamed(llm):
    greedy = llm.generate(["the cat sat on"], SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    stop = greedy.text[8:11]  # three characters from the middle of the greedy text
    assert len(stop) == 3 and stop.strip()
    params = SamplingParams(temperature=0, max_tokens=24, stop=[stop])
    final = llm.generate(["the cat sat on"], params, use_tqdm=False)[0]
    assert final.finish_reason == "stop" and stop not in final.text
    samples, outputs = stream(llm, "the cat sat on", params)
    text, _, _, reasons = samples[0]
    assert text == final.text and reasons[-1] == "stop"
    streamed_so_far = ""
    for output in outputs:  # no prefix of the text handed out ever held the stop string
        streamed_so_far += output.outputs[0].text if output.outputs else ""
        assert stop not in streamed_so_far


def test_an_aborted_stream_frees_its_blocks(llm):
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    engine.add_request("gone", "the cat sat on", params)
    for _ in range(3):
        engine.step()
    assert engine.num_free_blocks < engine.num_total_blocks
    engine.abort("gone")
    assert engine.num_free_blocks == engine.num_total_blocks and not engine.has_unfinished()
