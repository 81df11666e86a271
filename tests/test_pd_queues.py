"""Prefill and decode queues in one process: a real engine on each side, a real transfer
backend over loopback, the control channel in memory and a fake clock for the timeouts."""

from __future__ import annotations

import time

import pytest
import torch

from common.messages.kv_bootstrap import KVRequest
from common.messages.sampling import SamplingParams
from common.transfer.base import KVPoll
from engine_utils import EngineHarness, greedy
from pd_utils import PDPair


@pytest.fixture
def pair(tiny_llama_dir, request):
    backend = getattr(request, "param", "tcp")
    p = PDPair(tiny_llama_dir, backend=backend)
    yield p
    p.close()


def colocated(model_dir, prompts, sampling, page_size=4):
    h = EngineHarness(model_dir, page_size=page_size, max_total_tokens=1024)
    for i, prompt in enumerate(prompts):
        h.add(f"r{i}", prompt, sampling)
    h.run()
    return [h.outputs[f"r{i}"] for i in range(len(prompts))]


PROMPTS = [[5, 6, 7], list(range(10, 27)), list(range(40, 48)), [9] * 33]


@pytest.mark.parametrize("pair", ["tcp", "torch"], indirect=True)
def test_handoff_matches_colocated_greedy(pair, tiny_llama_dir):
    want = colocated(tiny_llama_dir, PROMPTS, greedy(10))
    for i, prompt in enumerate(PROMPTS):
        pair.submit(f"r{i}", prompt, greedy(10))
    pair.run()
    for i in range(len(PROMPTS)):
        assert pair.decode_outputs[f"r{i}"] == want[i]
        assert pair.decode_finish[f"r{i}"].type == "length"
        # prefill answers with the first token once the KV is delivered
        assert pair.prefill_outputs[f"r{i}"] == want[i][:1]
    assert pair.pools_whole()


def test_seeded_sampling_matches_colocated(pair, tiny_llama_dir):
    sampling = SamplingParams(max_new_tokens=8, temperature=0.9, seed=1234, ignore_eos=True)
    want = colocated(tiny_llama_dir, PROMPTS[:2], sampling)
    for i, prompt in enumerate(PROMPTS[:2]):
        pair.submit(f"r{i}", prompt, sampling)
    pair.run()
    assert [pair.decode_outputs["r0"], pair.decode_outputs["r1"]] == want


def test_first_token_logprobs_travel_with_the_kv(pair):
    pair.submit("r", PROMPTS[1], greedy(3), return_logprob=True, top_logprobs_num=2)
    pair.run()
    deltas = pair.decode_deltas["r"]
    logprobs = [lp for d in deltas for lp in d.output_logprobs]
    tops = [t for d in deltas for t in d.output_top_logprobs]
    assert len(logprobs) == 3 and all(lp <= 0 for lp in logprobs)
    assert len(tops[0].token_ids) == 2 and tops[0].token_ids[0] == pair.decode_outputs["r"][0]


def test_max_new_tokens_one_and_zero_finish_on_decode_without_a_step(pair):
    pair.submit("one", PROMPTS[0], greedy(1))
    pair.submit("zero", PROMPTS[2], greedy(0))
    pair.run()
    assert len(pair.decode_outputs["one"]) == 1
    assert pair.decode_outputs["zero"] == []
    assert pair.decode_finish["zero"].type == "length"
    assert pair.decode.num_steps == 0
    assert pair.pools_whole()


def test_prefill_waits_for_decode_indices_before_computing(pair):
    msg = pair.request("r", PROMPTS[1], greedy(4))
    pair.collect_prefill(pair.p.add(msg))
    for _ in range(5):
        pair.turn()
    assert pair.prefill.num_steps == 0 and len(pair.p.bootstrap) == 1
    snap = pair.p.load_snapshot()
    assert snap.num_bootstrap_reqs == 1 and snap.num_waiting_reqs == 1
    pair.collect_decode(pair.d.add(msg))
    pair.run()
    assert len(pair.decode_outputs["r"]) == 4 and pair.pools_whole()


def test_decode_indices_may_arrive_before_the_prefill_request(pair):
    msg = pair.request("r", PROMPTS[1], greedy(4))
    pair.collect_decode(pair.d.add(msg))
    for _ in range(3):
        pair.turn()
    assert len(pair.p.early) == 1 and len(pair.d.transfer) == 1
    snap = pair.d.load_snapshot()
    assert snap.num_transfer_reqs == 1 and snap.num_waiting_reqs == 1
    assert snap.num_active_tokens == snap.num_total_tokens - snap.num_used_tokens
    pair.collect_prefill(pair.p.add(msg))
    pair.run()
    assert len(pair.decode_outputs["r"]) == 4 and pair.pools_whole()


def test_prefill_bootstrap_timeout_frees_and_names_the_phase(pair):
    pair.collect_prefill(pair.p.add(pair.request("r", PROMPTS[1], greedy(4))))
    pair.turn()
    pair.clock.now += 6
    pair.turn()
    reason = pair.prefill_finish["r"]
    assert reason.type == "abort" and reason.status == 504 and "phase bootstrap" in reason.message
    assert pair.pools_whole() and not pair.p.waiting_on_io()


def test_decode_waiting_for_input_timeout_tells_prefill_and_frees(pair):
    pair.collect_decode(pair.d.add(pair.request("r", PROMPTS[1], greedy(4))))
    pair.turn()
    assert pair.decode.pool.allocator.num_used_pages > 0
    pair.clock.now += 6
    pair.turn()
    reason = pair.decode_finish["r"]
    assert reason.status == 504 and "waiting_for_input" in reason.message
    pair.turn()  # prefill drops the early KVRequest on the KVAbort
    assert not pair.p.early and pair.pools_whole()


def test_decode_bootstrap_timeout_without_free_pages(tiny_llama_dir):
    pair = PDPair(tiny_llama_dir, max_total_tokens=32)  # 8 pages of 4 tokens
    try:
        pair.collect_decode(pair.d.add(pair.request("big", [5] * 29, greedy(1))))
        pair.collect_decode(pair.d.add(pair.request("r", [5] * 20, greedy(1))))
        pair.turn()
        assert len(pair.d.transfer) == 1 and len(pair.d.prealloc) == 1  # r waits for pages
        pair.clock.now += 6
        pair.turn()
        assert "phase bootstrap" in pair.decode_finish["r"].message
    finally:
        pair.close()


def test_client_abort_in_each_phase_frees_both_pools(pair):
    # decode: prealloc (topology pending) / transfer; prefill: bootstrap / forward
    pair.directory.entry.state = pair.directory.entry.state.PENDING
    pair.collect_decode(pair.d.add(pair.request("pre", PROMPTS[1], greedy(4))))
    pair.turn()
    pair.collect_decode(pair.d.abort("pre", "client disconnected"))
    assert pair.decode_finish["pre"].type == "abort"
    pair.directory.entry.state = pair.directory.entry.state.READY

    msg = pair.request("xfer", PROMPTS[1], greedy(4))
    pair.collect_decode(pair.d.add(msg))
    pair.turn()
    pair.collect_decode(pair.d.abort("xfer", "client disconnected"))
    pair.turn()
    pair.collect_prefill(pair.p.add(msg))  # prefill arrives late: the room was abandoned
    pair.turn()
    pair.clock.now += 6
    pair.run()
    assert pair.prefill_finish["xfer"].type == "abort"

    msg = pair.request("boot", PROMPTS[1], greedy(4))
    pair.collect_prefill(pair.p.add(msg))
    pair.collect_prefill(pair.p.abort("boot", "client disconnected"))
    assert pair.prefill_finish["boot"].type == "abort"

    msg = pair.request("fwd", PROMPTS[3], greedy(4))
    pair.collect_prefill(pair.p.add(msg))
    pair.collect_decode(pair.d.add(msg))
    pair.turn()  # decode sent its indices
    pair.collect_prefill(pair.p.on_kv_request(pair.to_prefill.pop()))
    assert pair.p.forward  # the request is in prefill's engine, not yet computed
    pair.collect_prefill(pair.p.abort("fwd", "client disconnected"))
    pair.run()
    assert pair.decode_finish["fwd"].type == "abort"
    assert "prefill failed" in pair.decode_finish["fwd"].message
    assert pair.pools_whole()


def test_a_cancelled_room_never_receives_bytes(pair):
    """Decode gives up (abort) after sending its indices; prefill then sends anyway: the pages
    it would have written were freed and handed to another request, which must not see them."""
    msg = pair.request("late", PROMPTS[1], greedy(2))
    pair.collect_decode(pair.d.add(msg))
    pair.turn()
    kv = next(m for m in pair.to_prefill if isinstance(m, KVRequest))
    pair.collect_decode(pair.d.abort("late", "client disconnected"))
    pair.turn()
    assert pair.d.releasing == [] and pair.pools_whole()
    pages = kv.dst_pages
    pool = pair.decode.pool
    before = pool.k[:, pages[0] * 4:(pages[-1] + 1) * 4].clone()
    state = pair.sender.send(kv.kv_endpoint, kv.room, pages, pages,
                             __import__("common.transfer.base", fromlist=["x"]).TransferTrailer(
                                 first_token=1))
    deadline = time.monotonic() + 10
    while state.state not in (KVPoll.Success, KVPoll.Failed):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert state.state is KVPoll.Failed
    assert torch.equal(before, pool.k[:, pages[0] * 4:(pages[-1] + 1) * 4])


def test_misrouted_room_and_disagreeing_rooms_fail_clearly(tiny_llama_dir):
    pair = PDPair(tiny_llama_dir, prefill_slots=2)  # this prefill queue is rank 0 of 2
    try:
        pair.collect_prefill(pair.p.add(pair.request("odd", PROMPTS[0], greedy(2), room=7)))
        reason = pair.prefill_finish["odd"]
        assert reason.status == 503 and "follow_bootstrap_room" in reason.message
        # decode computed rank 1 for room 9 but sent it here: prefill says so to decode
        pair.collect_prefill(pair.p.on_kv_request(KVRequest(
            room=9, decode_rank=0, notify_endpoint="decode-rank-0", kv_endpoint="x:1",
            dst_pages=[0], prompt_len=3, prefill_dp_rank=0)))
        assert pair.to_decode and "rooms disagree" in pair.to_decode[0].message
        # same room, different prompts on the two sides
        msg = pair.request("a", PROMPTS[0], greedy(2), room=10)
        pair.collect_decode(pair.d.add(pair.request("a", PROMPTS[1], greedy(2), room=10)))
        pair.collect_prefill(pair.p.add(msg))
        pair.to_decode.clear()
        pair.run()
        assert pair.prefill_finish["a"].status == 409
        assert "different requests" in pair.decode_finish["a"].message
        assert pair.pools_whole()
    finally:
        pair.close()


def test_duplicate_rooms_and_missing_fields_are_refused(pair):
    msg = pair.request("a", PROMPTS[0], greedy(2), room=5)
    pair.collect_prefill(pair.p.add(msg))
    pair.collect_prefill(pair.p.add(pair.request("b", PROMPTS[0], greedy(2), room=5)))
    assert pair.prefill_finish["b"].status == 409
    pair.collect_decode(pair.d.add(msg))
    pair.collect_decode(pair.d.add(pair.request("c", PROMPTS[0], greedy(2), room=5)))
    assert pair.decode_finish["c"].status == 409
    from common.messages.scheduler_input import GenerateRequest

    pair.collect_decode(pair.d.add(GenerateRequest(rid="x", input_ids=[1], sampling=greedy(1))))
    assert pair.decode_finish["x"].status == 400
    pair.run()
    assert pair.pools_whole()


def test_decode_retracts_and_resumes_before_new_preallocations(tiny_llama_dir):
    pair = PDPair(tiny_llama_dir, max_total_tokens=64)  # 16 pages of 4 tokens
    try:
        for i in range(3):
            pair.submit(f"r{i}", [5 + i] * 10, greedy(20))
        pair.run()
        assert pair.decode.scheduler.num_retractions > 0
        want = colocated(tiny_llama_dir, [[5 + i] * 10 for i in range(3)], greedy(20))
        assert [pair.decode_outputs[f"r{i}"] for i in range(3)] == want
        assert pair.pools_whole()
    finally:
        pair.close()


def test_a_room_of_a_rank_that_is_not_serving_fails_fast(tiny_llama_dir):
    pair = PDPair(tiny_llama_dir, prefill_slots=2)  # only rank 0 is in the topology
    try:
        pair.collect_decode(pair.d.add(pair.request("r", PROMPTS[0], greedy(2), room=3)))
        pair.turn()
        reason = pair.decode_finish["r"]
        assert reason.status == 503 and "prefill rank 1" in reason.message
        assert pair.pools_whole()
    finally:
        pair.close()


def test_prefill_transfer_timeout_answers_at_once_and_frees_when_the_sender_lets_go(pair):
    from common.transfer.base import TransferState

    held = []

    class HoldingSender:  # a transfer that never ends by itself (a stalled peer)
        def send(self, endpoint, room, src_pages, dst_pages, trailer):
            state = TransferState()
            state.advance(KVPoll.Transferring)
            held.append(state)
            return state

    pair.p.sender = HoldingSender()
    pair.submit("r", PROMPTS[1], greedy(4))
    for _ in range(4):
        pair.turn()
    assert held and pair.p.inflight
    pair.clock.now += 6
    pair.turn()
    reason = pair.prefill_finish["r"]
    assert reason.status == 504 and "phase transferring" in reason.message
    assert pair.prefill.pool.allocator.num_used_pages > 0  # the sender may still read them
    held[0].pages_released = True
    pair.turn()
    pair.turn()  # decode failed too (its own timeout or prefill's word) and released its pages
    assert pair.decode_finish["r"].type == "abort"
    assert pair.pools_whole()


def test_decode_giving_up_during_prefill_forward_is_an_error_for_prefill_client(pair):
    from common.messages.kv_bootstrap import KVAbort

    msg = pair.request("r", PROMPTS[3], greedy(4))
    pair.collect_prefill(pair.p.add(msg))
    pair.collect_decode(pair.d.add(msg))
    pair.turn()  # decode sent its indices
    kv = pair.to_prefill.pop()
    pair.collect_prefill(pair.p.on_kv_request(kv))
    assert pair.p.forward
    pair.collect_prefill(pair.p.on_kv_abort(KVAbort(room=kv.room, reason="client left")))
    reason = pair.prefill_finish["r"]
    assert reason.type == "abort" and reason.status == 502 and "decode gave up" in reason.message
    pair.collect_decode(pair.d.abort("r", "client left"))
    pair.run()
    assert pair.pools_whole()
