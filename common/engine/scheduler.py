"""Continuous-batching scheduler: decides what the next forward pass runs.

Queues:
    waiting (deque)  --admit, possibly in chunks-->  running (list)  --finish/abort-->  freed
         ^                                              |
         +-------------- retract (KV ran short) --------+

Each step is either an *extend* batch or a *decode* batch. Extend has priority (as in
nano-vllm and SGLang): requests at the head of `waiting` are admitted while the token budget
(`chunked_prefill_size`), the running-request limit and the free pages allow. A prompt longer
than the remaining budget is run in chunks: it stays at the head of `waiting`, holding its
pages, until its last chunk completes, then joins `running`. Without waiting work, every
running request decodes one token. When decode needs a page and none is free, the most recently
admitted running requests are retracted (pages freed, prefilled again later over
prompt + outputs) so the oldest always progress.

Pure bookkeeping: no tensors, no model; the engine turns the returned segments into a forward.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from common.engine.kv_pool import PageAllocator
from common.engine.request import Req, ReqStatus
from common.engine.runner import Segment


@dataclass(slots=True)
class ScheduledBatch:
    is_extend: bool
    segments: list[Segment]


class Scheduler:
    def __init__(
        self,
        allocator: PageAllocator,
        page_size: int,
        max_running_requests: int,
        chunked_prefill_size: int,
    ):
        self.allocator = allocator
        self.page_size = page_size
        self.max_running_requests = max_running_requests
        self.chunked_prefill_size = chunked_prefill_size  # <= 0: no chunking
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.num_retractions = 0

    # ---- queue operations -------------------------------------------------------------
    def add(self, req: Req) -> None:
        self.waiting.append(req)

    def remove(self, req: Req) -> None:
        """Take a request out of whichever queue holds it and free its pages."""
        if req.status is ReqStatus.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._free(req)
        req.status = ReqStatus.FINISHED

    def detach(self, req: Req) -> None:
        """PD prefill: take a prefilled request out of the batch but keep its pages, which the
        KV transfer still reads; whoever detaches frees them (`allocator.free(req.pages)`)."""
        if req.status is ReqStatus.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = ReqStatus.FINISHED

    def adopt(self, req: Req) -> None:
        """PD decode: a request whose prompt KV arrived in pages it already holds joins the
        running batch directly (its first output token came from prefill)."""
        req.status = ReqStatus.RUNNING
        self.running.append(req)

    def is_idle(self) -> bool:
        return not self.waiting and not self.running

    @property
    def num_used_tokens(self) -> int:
        return self.allocator.num_used_pages * self.page_size

    # ---- scheduling -------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch | None:
        segments = self._schedule_extend()
        if segments:
            return ScheduledBatch(True, segments)
        segments = self._schedule_decode()
        return ScheduledBatch(False, segments) if segments else None

    def on_extend_done(self, batch: ScheduledBatch) -> None:
        """Move requests whose prefill completed from `waiting` to `running`."""
        for seg in batch.segments:
            req = seg.req
            req.num_computed = seg.end
            if seg.completes_fill and not req.finished:
                self.waiting.remove(req)
                req.status = ReqStatus.RUNNING
                self.running.append(req)

    def on_decode_done(self, batch: ScheduledBatch) -> None:
        for seg in batch.segments:
            seg.req.num_computed = seg.end

    def _pages_needed(self, req: Req, upto: int) -> int:
        return max(0, -(-upto // self.page_size) - len(req.pages))

    def _schedule_extend(self) -> list[Segment]:
        budget = self.chunked_prefill_size if self.chunked_prefill_size > 0 else float("inf")
        segments: list[Segment] = []
        for req in self.waiting:
            if len(self.running) + len(segments) >= self.max_running_requests or budget <= 0:
                break
            remaining = len(req.fill_ids) - req.num_computed
            length = int(min(remaining, budget))
            need = self._pages_needed(req, req.num_computed + length)
            # Keep one page of headroom per running request so admissions do not immediately
            # force retractions.
            if not self.allocator.can_alloc(need + len(self.running)):
                break
            req.pages.extend(self.allocator.alloc(need))
            segments.append(Segment(req, req.num_computed, length, req.wants_input_logprobs))
            budget -= length
            if length < remaining:
                break  # a chunked request goes alone at the tail of the batch
        return segments

    def _schedule_decode(self) -> list[Segment]:
        self.running.sort(key=lambda r: r.arrival_time)
        for req in list(self.running):
            if req.status is not ReqStatus.RUNNING:
                break  # retracted below, and so is everything newer
            need = self._pages_needed(req, req.seq_len)
            while not self.allocator.can_alloc(need):
                victim = self.running[-1]
                if victim is req and len(self.running) == 1:
                    # The front end bounds prompt + max_new_tokens by the pool, so a lone
                    # request always fits; reaching this means that invariant broke.
                    raise RuntimeError("KV pool too small for a single request")
                self._retract(victim)
                if victim is req:
                    break
            if req.status is ReqStatus.RUNNING:
                req.pages.extend(self.allocator.alloc(need))
        return [Segment(r, r.num_computed, r.seq_len - r.num_computed) for r in self.running]

    def _retract(self, req: Req) -> None:
        self.running.remove(req)
        self._free(req)
        req.num_computed = 0
        req.status = ReqStatus.WAITING
        self.waiting.appendleft(req)
        self.num_retractions += 1

    def _free(self, req: Req) -> None:
        if req.pages:
            self.allocator.free(req.pages)
            req.pages = []
