"""Engine behaviour without HTTP: stop conditions, aborts, sampling options, logprobs."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from common.messages.sampling import SamplingParams
from engine_utils import EngineHarness, greedy

PROMPT = list(range(40, 60))


@pytest.fixture(scope="module")
def harness(tiny_llama_dir):
    return EngineHarness(tiny_llama_dir, page_size=4)


def run_one(harness, sampling, prompt=PROMPT, rid="x", **kw):
    harness.outputs.pop(rid, None)
    harness.deltas.pop(rid, None)
    harness.add(rid, prompt, sampling, **kw)
    harness.run()
    assert harness.pool_whole
    return harness.outputs[rid], harness.finish[rid]


def test_max_new_tokens_and_length_reason(harness):
    out, reason = run_one(harness, greedy(7))
    assert len(out) == 7
    assert reason.type == "length" and reason.length == 7


def test_stop_token_ids_and_eos(harness):
    reference, _ = run_one(harness, greedy(12))
    stop_at = reference[4]
    first = reference.index(stop_at)
    out, reason = run_one(harness, greedy(12, stop_token_ids=[stop_at]))
    assert out == reference[: first + 1]
    assert reason.type == "stop" and reason.matched == stop_at
    # Without ignore_eos, the model's EOS (id 2) would stop; with it, generation continues.
    eos_logit_bias = SamplingParams(max_new_tokens=5, temperature=0.0, logit_bias={2: 100.0})
    out, reason = run_one(harness, eos_logit_bias)
    assert out == [2] and reason.type == "stop" and reason.matched == 2
    ignoring = SamplingParams(max_new_tokens=5, temperature=0.0, logit_bias={2: 100.0},
                              ignore_eos=True)
    out, reason = run_one(harness, ignoring)
    assert out == [2] * 5 and reason.type == "length"


def test_min_new_tokens_masks_eos(harness):
    sp = SamplingParams(max_new_tokens=6, temperature=0.0, logit_bias={2: 100.0}, min_new_tokens=3)
    out, reason = run_one(harness, sp)
    assert 2 not in out[:3] and out[3] == 2 and reason.type == "stop"


def test_stop_string(harness):
    reference, _ = run_one(harness, greedy(16))
    text = harness.engine.tokenizer.decode(reference)
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip(), "pick a visible stop string"
    out, reason = run_one(harness, greedy(16, stop=[stop]))
    assert reason.type == "stop" and reason.matched == stop
    assert len(out) < 16 and stop in harness.engine.tokenizer.decode(out)
    assert stop not in harness.engine.tokenizer.decode(out[:-1])


def test_abort_waiting_and_running_frees_pages(harness):
    harness.add("running", PROMPT, greedy(50))
    harness.step()  # prefill: now running
    harness.add("waiting", PROMPT, greedy(50))
    harness.abort("waiting")
    harness.step()
    harness.abort("running")
    assert not harness.engine.has_work()
    assert harness.finish["running"].type == "abort"
    assert harness.finish["waiting"].type == "abort"
    assert harness.pool_whole


def test_duplicate_rid_is_refused(harness):
    harness.add("dup", PROMPT, greedy(3))
    harness.add("dup", PROMPT, greedy(3))
    assert harness.finish["dup"].status == 409
    harness.finish.pop("dup")
    harness.run()
    assert harness.finish["dup"].type == "length"


def test_seeded_sampling_is_reproducible_and_independent_of_batch(harness):
    sp = SamplingParams(max_new_tokens=12, temperature=1.0, seed=1234, ignore_eos=True)
    alone, _ = run_one(harness, sp, rid="alone")
    # Same seed inside a batch with other sampled requests.
    harness.add("other", PROMPT[:5], SamplingParams(max_new_tokens=12, temperature=1.0,
                                                    ignore_eos=True))
    harness.add("batched", PROMPT, sp)
    harness.run()
    assert harness.outputs["batched"] == alone
    different, _ = run_one(harness, SamplingParams(max_new_tokens=12, temperature=1.0, seed=99,
                                                   ignore_eos=True), rid="other-seed")
    assert different != alone


def test_top_k_one_is_greedy_and_min_p_one_is_greedy(harness):
    reference, _ = run_one(harness, greedy(8), rid="g")
    top1, _ = run_one(harness, SamplingParams(max_new_tokens=8, temperature=1.5, top_k=1,
                                              ignore_eos=True), rid="k")
    assert top1 == reference
    min_p, _ = run_one(harness, SamplingParams(max_new_tokens=8, temperature=1.0, min_p=1.0,
                                               seed=3, ignore_eos=True), rid="m")
    assert min_p == reference
    tiny_p, _ = run_one(harness, SamplingParams(max_new_tokens=8, temperature=1.0, top_p=1e-6,
                                                seed=3, ignore_eos=True), rid="p")
    assert tiny_p == reference


def test_frequency_penalty_breaks_a_forced_repetition(harness):
    forced = greedy(8, logit_bias={7: 8.0})
    reference, _ = run_one(harness, forced, rid="g")
    assert reference == [7] * 8
    penalised, _ = run_one(harness, greedy(8, logit_bias={7: 8.0}, frequency_penalty=2.0), rid="f")
    assert penalised[0] == 7 and penalised != reference
    repeated, _ = run_one(harness, greedy(8, logit_bias={7: 8.0}, repetition_penalty=10.0),
                          rid="r")
    assert repeated[0] != 7 or repeated != reference  # 7 is in the prompt: penalised at once


def test_logprobs_match_hf(harness, tiny_llama_dir):
    out, _ = run_one(harness, greedy(6), return_logprob=True, logprob_start_len=0,
                     top_logprobs_num=3)
    deltas = harness.deltas["x"]
    output_lps = [lp for d in deltas for lp in d.output_logprobs]
    input_lps = next(d.input_logprobs for d in deltas if d.input_logprobs)
    tops = [t for d in deltas for t in d.output_top_logprobs]
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([PROMPT + out])).logits[0], dim=-1)
    seq = PROMPT + out
    expected_in = [None] + [ref[i - 1, seq[i]].item() for i in range(1, len(PROMPT))]
    assert input_lps[0] is None
    for got, want in zip(input_lps[1:], expected_in[1:]):
        assert math.isclose(got, want, abs_tol=2e-4)
    for i, got in enumerate(output_lps):
        assert math.isclose(got, ref[len(PROMPT) - 1 + i, out[i]].item(), abs_tol=2e-4)
    for i, top in enumerate(tops):
        assert len(top.token_ids) == 3
        assert top.token_ids[0] == out[i]  # greedy: the chosen token is the most likely
        assert top.logprobs == sorted(top.logprobs, reverse=True)


def test_prompt_logprobs_with_chunked_prefill(tiny_llama_dir):
    chunked = EngineHarness(tiny_llama_dir, page_size=4, chunked_prefill_size=6)
    whole = EngineHarness(tiny_llama_dir, page_size=4)
    for h in (chunked, whole):
        h.add("x", PROMPT, greedy(2), return_logprob=True, logprob_start_len=3)
        h.run()
    a = next(d.input_logprobs for d in chunked.deltas["x"] if d.input_logprobs)
    b = next(d.input_logprobs for d in whole.deltas["x"] if d.input_logprobs)
    assert len(a) == len(b) == len(PROMPT) - 3
    assert all(math.isclose(x, y, abs_tol=1e-4) for x, y in zip(a, b))


def test_max_new_tokens_zero_returns_prompt_logprobs_only(harness):
    out, reason = run_one(harness, greedy(0), return_logprob=True, logprob_start_len=0)
    assert out == [] and reason.type == "length" and reason.length == 0
    assert len(next(d.input_logprobs for d in harness.deltas["x"])) == len(PROMPT)
