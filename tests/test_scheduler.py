"""Scheduler and KV page accounting without a model."""

from __future__ import annotations

import pytest

from common.engine.kv_pool import KVPoolExhausted, PageAllocator
from common.engine.request import Req, ReqStatus
from common.engine.scheduler import Scheduler
from common.messages.sampling import SamplingParams


def make(rid: str, n: int, arrival: float = 0.0) -> Req:
    return Req(rid, list(range(n)), SamplingParams(max_new_tokens=100), arrival_time=arrival)


def fake_step(sched: Scheduler):
    """Run one schedule() and pretend the forward produced a token for finished fills."""
    batch = sched.schedule()
    if batch is None:
        return None
    (sched.on_extend_done if batch.is_extend else sched.on_decode_done)(batch)
    for seg in batch.segments:
        if seg.completes_fill:
            seg.req.output_ids.append(1)
    return batch


def test_allocator_accounting_and_double_free():
    alloc = PageAllocator(4)
    pages = alloc.alloc(3)
    assert alloc.num_free_pages == 1 and sorted(pages) == [0, 1, 2]
    with pytest.raises(KVPoolExhausted):
        alloc.alloc(2)
    alloc.free(pages)
    assert alloc.num_free_pages == 4
    with pytest.raises(RuntimeError, match="freed twice"):
        alloc.free([0])


def test_chunked_prefill_splits_and_holds_pages():
    sched = Scheduler(PageAllocator(100), page_size=4, max_running_requests=8,
                      chunked_prefill_size=10)
    req = make("a", 25)
    sched.add(req)
    lengths = []
    while req.status is ReqStatus.WAITING:
        batch = fake_step(sched)
        lengths.append(batch.segments[0].length)
    assert lengths == [10, 10, 5]
    assert req.num_computed == 25 and len(req.pages) == 7


def test_prefill_budget_packs_several_requests_then_decodes():
    sched = Scheduler(PageAllocator(100), page_size=4, max_running_requests=8,
                      chunked_prefill_size=16)
    for i, n in enumerate((5, 6, 9)):
        sched.add(make(str(i), n, arrival=i))
    batch = fake_step(sched)
    assert batch.is_extend and [s.length for s in batch.segments] == [5, 6, 5]
    batch = fake_step(sched)  # the rest of the chunked third request
    assert batch.is_extend and [s.length for s in batch.segments] == [4]
    batch = fake_step(sched)
    assert not batch.is_extend and [s.length for s in batch.segments] == [1, 1, 1]


def test_max_running_requests_limits_admission():
    sched = Scheduler(PageAllocator(100), page_size=1, max_running_requests=2,
                      chunked_prefill_size=-1)
    for i in range(3):
        sched.add(make(str(i), 3, arrival=i))
    fake_step(sched)
    assert len(sched.running) == 2 and len(sched.waiting) == 1


def test_decode_retracts_newest_when_pages_run_out():
    sched = Scheduler(PageAllocator(6), page_size=2, max_running_requests=8,
                      chunked_prefill_size=-1)
    old, new = make("old", 4, arrival=0), make("new", 4, arrival=1)
    sched.add(old)
    fake_step(sched)
    sched.add(new)
    fake_step(sched)  # both prefilled: 2 + 2 pages of 6 used, headroom kept
    assert len(sched.running) == 2
    while sched.num_retractions == 0:
        fake_step(sched)
    assert new.status is ReqStatus.WAITING and new.pages == [] and new.num_computed == 0
    assert old.status is ReqStatus.RUNNING
    assert sched.waiting[0] is new


def test_remove_frees_pages_in_any_state():
    alloc = PageAllocator(50)
    sched = Scheduler(alloc, page_size=4, max_running_requests=8, chunked_prefill_size=8)
    running, chunked = make("r", 4), make("c", 30)
    sched.add(running)
    fake_step(sched)
    sched.add(chunked)
    fake_step(sched)  # chunked holds pages while waiting
    assert chunked.status is ReqStatus.WAITING and chunked.pages
    sched.remove(chunked)
    sched.remove(running)
    assert alloc.num_free_pages == 50 and sched.is_idle()
