"""Sampler arithmetic on hand-made logits (no model)."""

from __future__ import annotations

import math

import torch

from common.engine.request import Req
from common.engine.sampler import Sampler
from common.messages.sampling import SamplingParams


def req(prompt=(1, 2), outputs=(), **sp) -> Req:
    r = Req("r", list(prompt), SamplingParams(**sp))
    r.output_ids = list(outputs)
    return r


SAMPLER = Sampler(vocab_size=6, eos_token_ids=[5], device=torch.device("cpu"))


def test_penalties_follow_the_documented_formulas():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5, 0.0, 0.0]])
    r = req(prompt=(0, 1), outputs=(2, 2, 3), repetition_penalty=2.0, frequency_penalty=0.5,
            presence_penalty=0.25)
    out = SAMPLER._adjust_logits(logits, [r])[0]
    # repetition: seen tokens {0,1,2,3}: positive / 2, negative * 2
    # frequency/presence on outputs: token 2 twice, token 3 once
    expected = torch.tensor([1.0, -4.0, 0.5 - 2 * 0.5 - 0.25, 0.25 - 0.5 - 0.25, 0.0, 0.0])
    torch.testing.assert_close(out, expected)
    assert logits[0, 0] == 2.0, "the caller's logits are not modified"


def test_min_new_tokens_bans_eos_and_stop_ids():
    logits = torch.zeros(1, 6)
    r = req(min_new_tokens=2, stop_token_ids=[4])
    out = SAMPLER._adjust_logits(logits, [r])[0]
    assert out[5] == -math.inf and out[4] == -math.inf and out[0] == 0


def test_top_k_top_p_min_p_filters():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1, 1e-9, 1e-9]]))
    probs = SAMPLER._filtered_probs(logits, [req(top_k=2)])[0]
    assert (probs[2:] == 0).all() and probs[:2].sum() > 0
    probs = SAMPLER._filtered_probs(logits, [req(top_p=0.65)])[0]
    assert (probs[:2] > 0).all() and (probs[2:] == 0).all()  # 0.4 + 0.3 covers 0.65
    probs = SAMPLER._filtered_probs(logits, [req(min_p=0.5)])[0]
    assert (probs[:2] > 0).all() and (probs[2:] == 0).all()  # keep p >= 0.5 * 0.4


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1, 1e-9, 1e-9, 1e-9]]))
    r = req(temperature=1.0, seed=0)
    counts = [0] * 6
    for _ in range(2000):
        counts[SAMPLER.sample(logits, [r]).token_ids[0]] += 1
    assert abs(counts[0] / 2000 - 0.7) < 0.05 and abs(counts[1] / 2000 - 0.2) < 0.05


def test_logprobs_are_of_the_raw_distribution():
    logits = torch.tensor([[3.0, 1.0, 0.0, 0.0, 0.0, 0.0]])
    r = req(temperature=0.0, frequency_penalty=1.0, outputs=(0,))
    r.return_logprob, r.top_logprobs_num = True, 2
    result = SAMPLER.sample(logits, [r])
    raw = torch.log_softmax(logits, -1)[0]
    assert result.token_ids == [0]
    assert math.isclose(result.logprobs[0], raw[0].item(), rel_tol=1e-6)
    assert result.top_logprobs[0].token_ids == [0, 1]
