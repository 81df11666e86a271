"""EngineCore: the in-process engine that the scheduler process wraps.

    add(GenerateRequest) -> waiting queue
    step():  batch = scheduler.schedule()  ->  logits = runner.forward(batch)
             -> postprocess: sample, append, check stops, free finished  -> TokenDeltas
    abort(rid)  frees the request's pages at once and reports it finished.

No sockets here: tests drive it directly, and `common/server/scheduler_process.py` puts a ZMQ
loop around it. PD roles plug in through two seams: `on_prefilled` (prefill: a request whose
first token was just sampled leaves the batch with its pages held, for the KV transfer) and
`adopt` (decode: a request whose KV arrived joins the running batch). Stop strings are checked here (so generation stops and KV is freed at once);
the detokenizer trims them from the text.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from common.config import ServerArgs
from common.engine.loader import LoadedModel
from common.engine.request import Req, ReqStatus
from common.engine.runner import ModelRunner, Segment, SegmentLogits
from common.engine.sampler import Sampler, top_logprobs_rows
from common.engine.scheduler import ScheduledBatch, Scheduler
from common.engine.tokenizer import Tokenizer
from common.loads.snapshot import LoadSnapshot
from common.messages.detokenizer_input import EngineStats, TokenDelta
from common.messages.sampling import FinishReason, TopLogprobs
from common.messages.scheduler_input import GenerateRequest

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(
        self,
        args: ServerArgs,
        loaded: LoadedModel,
        tokenizer: Tokenizer | None,
        dp_rank: int = 0,
    ):
        self.args = args
        self.dp_rank = dp_rank
        self.loaded = loaded
        self.pool = loaded.pool
        self.context_length = loaded.context_length
        self.tokenizer = tokenizer
        eos = set(loaded.config.eos_token_ids)
        if tokenizer is not None:
            eos |= tokenizer.eos_token_ids
        self.eos_token_ids = frozenset(eos)
        self.runner = ModelRunner(loaded.model, loaded.pool, loaded.device)
        self.scheduler = Scheduler(
            loaded.pool.allocator,
            args.page_size,
            args.max_running_requests,
            args.chunked_prefill_size,
        )
        self.sampler = Sampler(loaded.config.vocab_size, sorted(self.eos_token_ids), loaded.device)
        self.reqs: dict[str, Req] = {}
        self.num_steps = 0
        self.last_step_was_extend = False
        # PD prefill: called with (req, first token, its logprob, its top logprobs) instead of
        # continuing generation; the request is out of the batch and still holds its pages.
        self.on_prefilled: Callable[[Req, int, float | None, TopLogprobs | None], None] | None
        self.on_prefilled = None

    # ---- requests ---------------------------------------------------------------------
    def add(self, msg: GenerateRequest) -> list[TokenDelta]:
        """Queue a request; a duplicate rid is refused with an abort delta."""
        if msg.rid in self.reqs:
            dup = Req(msg.rid, list(msg.input_ids), msg.sampling)
            dup.finish_reason = FinishReason(
                type="abort", message=f"rid {msg.rid!r} is already in flight", status=409
            )
            return [self.delta(dup)]
        req = Req(
            rid=msg.rid,
            prompt_ids=list(msg.input_ids),
            sampling=msg.sampling,
            stream=msg.stream,
            return_logprob=msg.return_logprob,
            logprob_start_len=msg.logprob_start_len,
            top_logprobs_num=msg.top_logprobs_num,
        )
        self.reqs[req.rid] = req
        self.scheduler.add(req)
        return []

    def adopt(self, req: Req) -> list[TokenDelta]:
        """PD decode: `req` holds pages with its prompt's KV and one output token (sampled on
        prefill); it joins the running batch, or finishes at once if that token ends it."""
        self.reqs[req.rid] = req
        req.num_computed = len(req.prompt_ids)
        req.input_logprobs_done = True
        self.sampler.skip_draws(req, len(req.output_ids))
        self.scheduler.adopt(req)
        if req.sampling.max_new_tokens == 0:
            req.output_ids.clear()
            req.output_logprobs.clear()
            req.output_top_logprobs.clear()
            req.finish_reason = FinishReason(type="length", length=0)
        else:
            req.finish_reason = self._check_stop(req)
        if req.finished:
            return [self._finish(req)]
        return [self.delta(req)] if req.stream else []

    def abort(self, rid: str, message: str = "aborted",
              status: int | None = None) -> list[TokenDelta]:
        """Finish a request now and free its pages; `status` is the HTTP error its client gets
        (None: the client is gone or asked for it)."""
        req = self.reqs.get(rid)
        if req is None:
            return []
        req.finish_reason = FinishReason(type="abort", message=message, status=status)
        return [self._finish(req)]

    def flush_cache(self) -> tuple[bool, str]:
        """There is no prefix cache yet, so flushing only checks that the pool is whole."""
        if not self.scheduler.is_idle():
            return False, "cannot flush the cache while requests are running"
        allocator = self.pool.allocator
        if allocator.num_free_pages != allocator.num_total_pages:
            return False, f"{allocator.num_used_pages} KV pages are still held"
        allocator.reset()
        return True, "cache flushed"

    def stats(self, request_id: str) -> EngineStats:
        allocator = self.pool.allocator
        return EngineStats(
            request_id=request_id,
            dp_rank=self.dp_rank,
            num_running_reqs=len(self.scheduler.running),
            num_waiting_reqs=len(self.scheduler.waiting),
            num_free_pages=allocator.num_free_pages,
            num_total_pages=allocator.num_total_pages,
            page_size=self.pool.page_size,
            num_retractions=self.scheduler.num_retractions,
            num_steps=self.num_steps,
        )

    def load_snapshot(self) -> LoadSnapshot:
        """SPEC section 3, for a colocated rank: no KV is ever in flight, so active == total."""
        sched, allocator = self.scheduler, self.pool.allocator
        used = allocator.num_used_pages * self.pool.page_size
        to_compute = sum(len(r.fill_ids) - r.num_computed for r in sched.waiting)
        capacity = self.pool.capacity_tokens
        return LoadSnapshot(
            dp_rank=self.dp_rank,
            timestamp=time.time(),
            num_running_reqs=len(sched.running),
            num_waiting_reqs=len(sched.waiting),
            num_used_tokens=used,
            num_total_tokens=used + to_compute,
            num_active_tokens=used + to_compute,
            max_total_num_tokens=capacity,
            token_usage=used / capacity,
        )

    def has_work(self) -> bool:
        return not self.scheduler.is_idle()

    # ---- the step ---------------------------------------------------------------------
    def step(self) -> list[TokenDelta]:
        batch = self.scheduler.schedule()
        if batch is None:
            return []
        logits, where = self.runner.forward(batch.segments)
        return self._postprocess(batch, logits, where)

    def _postprocess(
        self, batch: ScheduledBatch, logits: torch.Tensor, where: list[SegmentLogits | None]
    ) -> list[TokenDelta]:
        self.num_steps += 1
        self.last_step_was_extend = batch.is_extend
        if batch.is_extend:
            self.scheduler.on_extend_done(batch)
        else:
            self.scheduler.on_decode_done(batch)
        sample_rows, sample_reqs = [], []
        for seg, loc in zip(batch.segments, where):
            if loc is None:
                continue
            if seg.all_logits:
                self._record_input_logprobs(seg, logits[loc.first : loc.first + loc.count])
            if seg.completes_fill:
                sample_rows.append(loc.first + loc.count - 1)
                sample_reqs.append(seg.req)
        deltas: list[TokenDelta] = []
        if sample_reqs:
            result = self.sampler.sample(logits[sample_rows], sample_reqs)
            for i, req in enumerate(sample_reqs):
                req.input_logprobs_done = True
                if self.on_prefilled is not None:
                    self._hand_off(req, result, i)
                    continue
                if req.sampling.max_new_tokens == 0:  # prompt logprobs only
                    req.finish_reason = FinishReason(type="length", length=0)
                    deltas.append(self._finish(req))
                    continue
                req.output_ids.append(result.token_ids[i])
                if result.logprobs is not None and req.return_logprob:
                    req.output_logprobs.append(result.logprobs[i])
                    req.output_top_logprobs.append(result.top_logprobs[i])
                req.finish_reason = self._check_stop(req)
                if req.finished:
                    deltas.append(self._finish(req))
                elif req.stream:
                    deltas.append(self.delta(req))
        return deltas

    def _hand_off(self, req: Req, result, i: int) -> None:
        logprob = top = None
        if result.logprobs is not None and req.return_logprob:
            logprob, top = result.logprobs[i], result.top_logprobs[i]
        self.scheduler.detach(req)
        self.reqs.pop(req.rid, None)
        self.on_prefilled(req, result.token_ids[i], logprob, top)

    def _record_input_logprobs(self, seg: Segment, logits: torch.Tensor) -> None:
        """Row r predicts fill token start + r + 1; keep those still inside the prompt."""
        req = seg.req
        prompt_len = len(req.prompt_ids)
        if seg.start == 0:
            req.input_logprobs.append(None)  # nothing predicts the first token
            req.input_top_logprobs.append(top_logprobs_rows(logits[:0], [0])[0])
        last = min(seg.end, prompt_len - 1) - seg.start  # rows predicting prompt tokens
        if last <= 0:
            return
        logprobs = torch.log_softmax(logits[:last], dim=-1)
        targets = torch.tensor(req.prompt_ids[seg.start + 1 : seg.start + 1 + last])
        req.input_logprobs.extend(logprobs.gather(1, targets[:, None].to(logprobs.device))
                                  .squeeze(1).tolist())
        req.input_top_logprobs.extend(
            top_logprobs_rows(logprobs, [req.top_logprobs_num] * last)
        )

    def _check_stop(self, req: Req) -> FinishReason | None:
        sp = req.sampling
        token = req.output_ids[-1]
        if len(req.output_ids) >= sp.min_new_tokens:
            if token in sp.stop_token_ids or (not sp.ignore_eos and token in self.eos_token_ids):
                return FinishReason(type="stop", matched=token)
            if sp.stop and self.tokenizer is not None:
                longest = max(len(s) for s in sp.stop)
                tail = self.tokenizer.decode(
                    req.output_ids[-(longest + 2):], skip_special_tokens=sp.skip_special_tokens
                )
                for stop in sp.stop:
                    if stop in tail:
                        return FinishReason(type="stop", matched=stop)
        if len(req.output_ids) >= sp.max_new_tokens:
            return FinishReason(type="length", length=sp.max_new_tokens)
        if req.seq_len >= self.context_length:
            return FinishReason(type="length", length=len(req.output_ids))
        return None

    # ---- outputs ----------------------------------------------------------------------
    def _finish(self, req: Req) -> TokenDelta:
        if req.status is not ReqStatus.FINISHED:
            self.scheduler.remove(req)
        self.reqs.pop(req.rid, None)
        return self.delta(req)

    def delta(self, req: Req) -> TokenDelta:
        sent = req.num_sent
        req.num_sent = len(req.output_ids)
        first = sent == 0
        start = max(req.logprob_start_len, 0)
        return TokenDelta(
            rid=req.rid,
            new_ids=req.output_ids[sent:],
            prompt_tokens=len(req.prompt_ids),
            completion_tokens=len(req.output_ids),
            finished=req.finished,
            finish_reason=req.finish_reason,
            skip_special_tokens=req.sampling.skip_special_tokens,
            stop=req.sampling.stop,
            no_stop_trim=req.sampling.no_stop_trim,
            output_logprobs=req.output_logprobs[sent:],
            output_top_logprobs=req.output_top_logprobs[sent:],
            input_logprobs=req.input_logprobs[start:] if first else [],
            input_top_logprobs=req.input_top_logprobs[start:] if first else [],
            input_logprob_start=start,
            dp_rank=self.dp_rank,
        )
