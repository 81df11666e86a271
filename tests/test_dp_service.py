"""A real service with several DP ranks behind a DataParallelController (SPEC sections 1-3).

One round_robin service with dp 3 of 4 slots, one follow_bootstrap_room service, one
total_tokens service; every request goes through HTTP, and `meta_info.dp_rank` tells where it
ran.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import Counter

import pytest

from engine_utils import EngineHarness, greedy
from server_utils import ServerProcess, http_json

PROMPTS = [[5, 6, 7, 8], [100, 101], list(range(40, 70))]


def gen(server, **body):
    body.setdefault("input_ids", [5, 6, 7])
    body.setdefault("sampling_params", {"max_new_tokens": 2, "temperature": 0})
    return http_json(server.url + "/generate", body)


def rank_of(server, **body) -> int:
    status, reply = gen(server, **body)
    assert status == 200, reply
    return reply["meta_info"]["dp_rank"]


def loads(server, **query) -> dict:
    q = "&".join(f"{k}={v}" for k, v in query.items())
    status, body = http_json(f"{server.url}/v1/loads?{q}")
    assert status == 200, body
    return body


@pytest.fixture(scope="module")
def rr_server(tiny_llama_dir):
    with ServerProcess(tiny_llama_dir, "--dp-size", "3", "--max-ep-size", "4",
                       "--max-total-tokens", "2048", "--max-running-requests", "2",
                       "--load-publish-steps", "1") as server:
        yield server


def test_round_robin_cycles_over_active_ranks(rr_server):
    ranks = [rank_of(rr_server) for _ in range(6)]
    assert sorted(ranks) == [0, 0, 1, 1, 2, 2]
    assert ranks[:3] == ranks[3:]  # a fixed cycle over the three active ranks
    status, info = http_json(rr_server.url + "/get_server_info")
    assert info["load_balance_method"] == "round_robin" and info["dp_size"] == 3
    assert [s["dp_rank"] for s in info["internal_states"]] == [0, 1, 2]


def test_routed_rank_is_honoured_and_validated(rr_server):
    assert [rank_of(rr_server, routed_dp_rank=2) for _ in range(3)] == [2, 2, 2]
    status, body = gen(rr_server, routed_dp_rank=4)
    assert status == 400 and body["error"]["param"] == "routed_dp_rank"
    status, body = gen(rr_server, routed_dp_rank=3)  # a reserved slot
    assert status == 503 and "reserved" in body["error"]["message"]


def test_greedy_outputs_equal_single_rank_engine(rr_server, tiny_llama_dir):
    reference = EngineHarness(tiny_llama_dir)
    for i, p in enumerate(PROMPTS):
        reference.add(str(i), p, greedy(8))
    reference.run()
    for rank in (0, 1, 2):
        for i, p in enumerate(PROMPTS):
            status, body = gen(rr_server, input_ids=p, routed_dp_rank=rank, sampling_params={
                "max_new_tokens": 8, "temperature": 0, "ignore_eos": True})
            assert status == 200 and body["output_ids"] == reference.outputs[str(i)]


def test_loads_reflect_queued_work_on_the_right_rank(rr_server):
    long = {"input_ids": list(range(10, 60)), "routed_dp_rank": 1,
            "sampling_params": {"max_new_tokens": 150, "temperature": 0, "ignore_eos": True}}
    threads = [threading.Thread(target=http_json, args=(rr_server.url + "/generate", long, 180))
               for _ in range(4)]
    for t in threads:
        t.start()
    seen_waiting = seen_tokens = 0
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        rank1 = loads(rr_server, dp_rank=1)["loads"][0]
        seen_waiting = max(seen_waiting, rank1["num_waiting_reqs"])
        seen_tokens = max(seen_tokens, rank1["num_total_tokens"])
        others = [loads(rr_server, dp_rank=r)["loads"][0] for r in (0, 2)]
        assert all(o["num_running_reqs"] == 0 for o in others)
        if seen_waiting >= 2 and seen_tokens >= 100:
            break
        time.sleep(0.02)
    assert seen_waiting >= 2, "max-running-requests 2 leaves two of four waiting"
    assert seen_tokens >= 100
    for t in threads:
        t.join(180)
    deadline = time.monotonic() + 10
    while loads(rr_server, dp_rank=1)["loads"][0]["num_total_tokens"] and \
            time.monotonic() < deadline:
        time.sleep(0.05)
    body = loads(rr_server)
    assert [e["num_total_tokens"] for e in body["loads"][:3]] == [0, 0, 0]
    assert body["aggregate"]["num_running_reqs"] == 0
    assert body["loads"][3] == {"dp_rank": 3, "state": "reserved", "stale": True}
    status, _ = http_json(f"{rr_server.url}/v1/loads?dp_rank=9")
    assert status == 404
    import urllib.request

    with urllib.request.urlopen(f"{rr_server.url}/v1/loads?format=prometheus") as resp:
        text = resp.read().decode()
    assert 'pdserve_load_num_total_tokens{dp_rank="1",state="active"} 0' in text
    with urllib.request.urlopen(f"{rr_server.url}/metrics") as resp:
        metrics = resp.read().decode()
    assert 'pdserve_num_running_reqs{dp_rank="0"}' in metrics
    assert "pdserve_generation_tokens_total" in metrics


def test_elastic_activation_and_removal(rr_server):
    status, body = http_json(rr_server.url + "/dp_ranks/3", {"active": True}, timeout=120)
    assert status == 200 and body["ranks"][3]["state"] == "active"
    assert sorted(rank_of(rr_server) for _ in range(4)) == [0, 1, 2, 3]
    status, body = http_json(rr_server.url + "/dp_ranks/3", {"active": False})
    assert status == 200 and body["ranks"][3]["state"] == "reserved"
    assert 3 not in {rank_of(rr_server) for _ in range(6)}
    status, body = http_json(rr_server.url + "/dp_ranks/7", {"active": True})
    assert status == 404


def test_dead_scheduler_is_skipped_and_reported(rr_server):
    """Runs last in this module: it kills rank 1."""
    status, info = http_json(rr_server.url + "/get_server_info")
    os.kill(info["process_pids"]["scheduler-1"], signal.SIGKILL)
    deadline = time.monotonic() + 10
    while True:
        status, health = http_json(rr_server.url + "/health")
        if health.get("status") == "degraded" or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert status == 200 and health == {"status": "degraded", "unavailable_dp_ranks": [1]}
    assert Counter(rank_of(rr_server) for _ in range(6)) == {0: 3, 2: 3}
    status, body = gen(rr_server, routed_dp_rank=1)
    assert status == 503
    assert "scheduler-1 process" in rr_server.log_text()
    status, info = http_json(rr_server.url + "/get_server_info")
    assert [s["dp_rank"] for s in info["internal_states"]] == [0, 2]


@pytest.fixture(scope="module")
def room_server(tiny_llama_dir):
    with ServerProcess(tiny_llama_dir, "--dp-size", "3", "--max-ep-size", "4",
                       "--load-balance-method", "follow_bootstrap_room",
                       "--max-total-tokens", "1024") as server:
        yield server


def test_rooms_map_modulo_all_slots(room_server):
    assert [rank_of(room_server, bootstrap_room=r) for r in (0, 5, 6, 2**63 - 4)] == [0, 1, 2, 0]
    status, body = gen(room_server, bootstrap_room=7)  # slot 3 is reserved
    assert status == 503 and body["error"]["param"] == "bootstrap_room"
    status, body = gen(room_server)
    assert status == 400 and "router" in body["error"]["message"]
    status, body = http_json(room_server.url + "/generate", {
        "input_ids": [[1, 2], [3, 4]], "bootstrap_room": [4, 9],
        "sampling_params": {"max_new_tokens": 1}})
    assert status == 200 and [b["meta_info"]["dp_rank"] for b in body] == [0, 1]


def test_total_tokens_spreads_a_batch(tiny_llama_dir):
    with ServerProcess(tiny_llama_dir, "--dp-size", "2", "--load-balance-method",
                       "total_tokens", "--max-total-tokens", "1024") as server:
        status, body = http_json(server.url + "/generate", {
            "input_ids": [[5, 6, 7]] * 8, "sampling_params": {"max_new_tokens": 1}})
        assert status == 200
        assert Counter(b["meta_info"]["dp_rank"] for b in body) == {0: 4, 1: 4}
        status, info = http_json(server.url + "/get_server_info")
        assert info["load_balance_method"] == "total_tokens"
