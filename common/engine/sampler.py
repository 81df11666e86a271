"""Turns a batch of logits into next tokens, one row per request.

Order of processing, as in vLLM/HF: logit bias and min-new-tokens masking -> repetition,
frequency and presence penalties -> temperature -> top-k -> top-p -> min-p -> draw. Greedy rows
(temperature 0 or top_k 1) take the argmax of the processed logits. Each sampled row draws
from its own `torch.Generator`, seeded from the request's `seed` when given, so a seeded
request yields the same tokens whatever else shares its batch.

Reported logprobs are those of the raw model distribution (log_softmax of the logits before
any processing), as OpenAI and vLLM report them.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from common.engine.request import Req
from common.messages.sampling import TopLogprobs


@dataclass(slots=True)
class SampleResult:
    token_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[TopLogprobs] | None


def top_logprobs_rows(logprobs: torch.Tensor, nums: Sequence[int]) -> list[TopLogprobs]:
    """Per row the `nums[i]` most likely tokens; rows with 0 get an empty entry."""
    k = max(nums, default=0)
    if k == 0:
        return [TopLogprobs([], []) for _ in nums]
    values, ids = logprobs.topk(k, dim=-1)
    values, ids = values.tolist(), ids.tolist()
    return [TopLogprobs(ids[i][:n], values[i][:n]) for i, n in enumerate(nums)]


class Sampler:
    def __init__(self, vocab_size: int, eos_token_ids: Sequence[int], device: torch.device):
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.device = device

    def generator_for(self, req: Req) -> torch.Generator:
        if req.generator is None:
            seed = req.sampling.seed if req.sampling.seed is not None else random.getrandbits(63)
            req.generator = torch.Generator(device=self.device).manual_seed(seed % 2**63)
        return req.generator

    def skip_draws(self, req: Req, count: int) -> None:
        """Advance a sampled request's generator past `count` tokens drawn elsewhere (PD: the
        first token was sampled on prefill), so a seed gives the same text as colocated."""
        if req.sampling.is_greedy:
            return
        scratch = torch.empty(self.vocab_size, device=self.device)
        for _ in range(count):
            scratch.exponential_(generator=self.generator_for(req))

    def sample(self, logits: torch.Tensor, reqs: Sequence[Req]) -> SampleResult:
        want_logprobs = any(r.return_logprob for r in reqs)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
        logits = self._adjust_logits(logits, reqs)
        greedy_ids = logits.argmax(dim=-1)
        token_ids = greedy_ids.tolist()
        sampled_rows = [i for i, r in enumerate(reqs) if not r.sampling.is_greedy]
        if sampled_rows:
            probs = self._filtered_probs(logits[sampled_rows], [reqs[i] for i in sampled_rows])
            for row, i in enumerate(sampled_rows):
                # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p.
                noise = torch.empty_like(probs[row]).exponential_(
                    generator=self.generator_for(reqs[i])
                )
                token_ids[i] = int((probs[row] / noise).argmax())
        if raw_logprobs is None:
            return SampleResult(token_ids, None, None)
        chosen = raw_logprobs.gather(1, torch.tensor(token_ids, device=logits.device)[:, None])
        tops = top_logprobs_rows(raw_logprobs, [r.top_logprobs_num for r in reqs])
        return SampleResult(token_ids, chosen.squeeze(1).tolist(), tops)

    def _adjust_logits(self, logits: torch.Tensor, reqs: Sequence[Req]) -> torch.Tensor:
        needs = [
            i
            for i, r in enumerate(reqs)
            if r.sampling.logit_bias
            or len(r.output_ids) < r.sampling.min_new_tokens
            or r.sampling.repetition_penalty != 1.0
            or r.sampling.frequency_penalty != 0.0
            or r.sampling.presence_penalty != 0.0
        ]
        if not needs:
            return logits
        logits = logits.clone()
        for i in needs:
            self._adjust_row(logits[i], reqs[i])
        # Extreme penalties or biases must not turn into NaN probabilities downstream.
        return torch.nan_to_num(
            logits, nan=float("-inf"), posinf=torch.finfo(logits.dtype).max, neginf=float("-inf")
        )

    def _adjust_row(self, row: torch.Tensor, req: Req) -> None:
        sp = req.sampling
        for token, bias in sp.logit_bias.items():
            row[token] += bias
        if len(req.output_ids) < sp.min_new_tokens:
            banned = list(sp.stop_token_ids) + ([] if sp.ignore_eos else self.eos_token_ids)
            row[banned] = float("-inf")
        if sp.repetition_penalty != 1.0:
            seen = torch.tensor(req.fill_ids, device=row.device).unique()
            scores = row[seen]
            row[seen] = torch.where(
                scores > 0, scores / sp.repetition_penalty, scores * sp.repetition_penalty
            )
        if (sp.frequency_penalty != 0.0 or sp.presence_penalty != 0.0) and req.output_ids:
            counts = torch.bincount(
                torch.tensor(req.output_ids, device=row.device), minlength=self.vocab_size
            )[: row.shape[0]].to(row.dtype)
            row -= sp.frequency_penalty * counts + sp.presence_penalty * (counts > 0).to(row.dtype)

    @staticmethod
    def _filtered_probs(logits: torch.Tensor, reqs: Sequence[Req]) -> torch.Tensor:
        temps = torch.tensor([r.sampling.temperature for r in reqs], device=logits.device)
        probs = torch.softmax(logits / temps[:, None], dim=-1)
        top_ks = [r.sampling.top_k for r in reqs]
        top_ps = [r.sampling.top_p for r in reqs]
        if any(k > 0 for k in top_ks) or any(p < 1.0 for p in top_ps):
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            ranks = torch.arange(probs.shape[-1], device=probs.device)[None, :]
            k = torch.tensor([k if k > 0 else probs.shape[-1] for k in top_ks], device=probs.device)
            p = torch.tensor(top_ps, device=probs.device, dtype=probs.dtype)
            mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
            drop = (ranks >= k[:, None]) | (mass_before > p[:, None])
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(1, order, sorted_probs)
        min_ps = [r.sampling.min_p for r in reqs]
        if any(m > 0 for m in min_ps):
            m = torch.tensor(min_ps, device=probs.device, dtype=probs.dtype)
            probs = probs.masked_fill(probs < m[:, None] * probs.max(dim=-1).values[:, None], 0.0)
        return probs
