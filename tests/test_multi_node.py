"""Two node process groups of one service on this machine (`--nnodes 2`): node 0 runs the
front end, controller, detokenizer and rank 0; node 1 runs rank 1 and reaches node 0 only
through `--dist-init-addr`. Its snapshots are relayed into node 0's board by whichever process
owns the relay: the controller for load-aware methods, the front end otherwise."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from engine_utils import EngineHarness, greedy
from server_utils import ServerProcess, free_port_block, http_json

PROMPT = list(range(20, 40))


def wait_all_ranks_published(server: ServerProcess, timeout: float = 90) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        status, body = http_json(server.url + "/v1/loads")
        if status == 200 and all("timestamp" in e and not e["stale"] for e in body["loads"]):
            return body
        assert time.monotonic() < deadline, body
        time.sleep(0.2)


def wait_until_idle(server: ServerProcess, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while True:
        status, body = http_json(server.url + "/v1/loads")
        if all(e.get("num_running_reqs") == 0 and e.get("num_waiting_reqs") == 0
               for e in body["loads"]):
            return
        assert time.monotonic() < deadline, body
        time.sleep(0.05)


def start_node1(model_dir, common: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "common.cli", "serve", "--model-path", str(model_dir),
         *common, "--node-rank", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )


def stop_node(proc: subprocess.Popen) -> int:
    proc.terminate()
    try:
        return proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait(5)


def two_node_args(method: str, *extra: str) -> list[str]:
    addr = f"127.0.0.1:{free_port_block(4)}"  # detokenizer, relay, one scheduler per rank
    return ["--dp-size", "2", "--nnodes", "2", "--dist-init-addr", addr,
            "--load-balance-method", method, "--max-total-tokens", "1024", *extra]


@pytest.mark.parametrize("method", ["total_requests", "round_robin"])
def test_two_nodes_serve_one_service(tiny_llama_dir, method):
    common = two_node_args(method)
    worker = start_node1(tiny_llama_dir, common)
    try:
        with ServerProcess(tiny_llama_dir, *common, "--node-rank", "0") as head:
            loads = wait_all_ranks_published(head)
            assert [e["dp_rank"] for e in loads["loads"]] == [0, 1]
            reference = EngineHarness(tiny_llama_dir)
            reference.add("x", PROMPT, greedy(6))
            reference.run()
            for rank in (0, 1):
                status, body = http_json(head.url + "/generate", {
                    "input_ids": PROMPT, "routed_dp_rank": rank,
                    "sampling_params": {"max_new_tokens": 6, "temperature": 0,
                                        "ignore_eos": True}})
                assert status == 200, body
                assert body["meta_info"]["dp_rank"] == rank
                assert body["output_ids"] == reference.outputs["x"]
            # The load-aware budget reads the board: wait until both ranks' "done" snapshots
            # are in (rank 1's travel through the relay, after its answer reached us).
            wait_until_idle(head)
            status, body = http_json(head.url + "/generate", {
                "input_ids": [[1, 2, 3]] * 4, "sampling_params": {"max_new_tokens": 1}})
            assert sorted(b["meta_info"]["dp_rank"] for b in body) == [0, 0, 1, 1]
            status, info = http_json(head.url + "/get_server_info")
            assert [s["dp_rank"] for s in info["internal_states"]] == [0, 1]
    finally:
        code = stop_node(worker)
    assert code == 0, worker.stderr.read()[-3000:]


def _rank_state(head: ServerProcess, rank: int) -> str:
    status, body = http_json(head.url + f"/v1/loads?dp_rank={rank}")
    assert status == 200, body
    return body["loads"][0]["state"]


def _wait_rank_state(head: ServerProcess, rank: int, state: str, timeout: float) -> float:
    start = time.monotonic()
    while _rank_state(head, rank) != state:
        assert time.monotonic() - start < timeout, f"rank {rank} never became {state}"
        time.sleep(0.1)
    return time.monotonic() - start


def _run_on_rank1_then(head: ServerProcess, pool, action):
    """Starts a long request on rank 1, calls `action()` once rank 1 is decoding it, returns
    the request's future."""
    long_request = {"input_ids": PROMPT, "routed_dp_rank": 1,
                    "sampling_params": {"max_new_tokens": 480, "temperature": 0,
                                        "ignore_eos": True}}
    running = pool.submit(http_json, head.url + "/generate", long_request, 90)
    deadline = time.monotonic() + 20
    while True:  # until rank 1 is decoding it
        status, body = http_json(head.url + "/v1/loads?dp_rank=1")
        if body["loads"][0].get("num_running_reqs"):
            break
        assert not running.done() and time.monotonic() < deadline, body
        time.sleep(0.01)
    action()
    return running


def test_node0_fails_what_a_quickly_restarted_node_held(tiny_llama_dir):
    """Node 1 restarts well within --remote-rank-timeout: node 0 sees a new scheduler process
    in rank 1's snapshots and fails the request the old one held (it would wait forever);
    the rank stays in service."""
    import concurrent.futures

    common = two_node_args("round_robin", "--remote-rank-timeout", "120")
    nodes = [start_node1(tiny_llama_dir, common)]
    try:
        with ServerProcess(tiny_llama_dir, *common, "--node-rank", "0") as head:
            wait_all_ranks_published(head)

            def restart_node1() -> None:
                os.killpg(nodes[0].pid, signal.SIGKILL)
                nodes[0].wait(10)
                nodes.append(start_node1(tiny_llama_dir, common))

            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                running = _run_on_rank1_then(head, pool, restart_node1)
                status, body = running.result(timeout=90)
            assert status == 503 and "restarted" in body["error"]["message"], body
            assert _rank_state(head, 1) == "active"
            status, body = http_json(head.url + "/generate", {
                "input_ids": PROMPT, "routed_dp_rank": 1, "sampling_params": {"max_new_tokens": 2}})
            assert status == 200 and body["meta_info"]["dp_rank"] == 1, body
    finally:
        for node in nodes:
            if node.poll() is None:
                stop_node(node)


def test_node0_takes_a_lost_node_out_of_service_and_back(tiny_llama_dir):
    """Node 1 is killed while a request runs on its rank: after --remote-rank-timeout, node 0
    marks the rank unavailable, that request fails with 503, new requests go to rank 0 only;
    a new node 1 brings the rank back."""
    import concurrent.futures

    common = two_node_args("round_robin", "--remote-rank-timeout", "2")
    worker = start_node1(tiny_llama_dir, common)
    try:
        with ServerProcess(tiny_llama_dir, *common, "--node-rank", "0") as head:
            wait_all_ranks_published(head)
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                # the whole node, without a goodbye
                running = _run_on_rank1_then(head, pool,
                                             lambda: os.killpg(worker.pid, signal.SIGKILL))
                worker.wait(10)
                took = _wait_rank_state(head, 1, "unavailable", timeout=20)
                status, body = running.result(timeout=30)
            assert status == 503, body
            assert "no load snapshot" in body["error"]["message"]
            assert took < 10
            status, health = http_json(head.url + "/health")
            assert (status, health) == (200, {"status": "degraded",
                                              "unavailable_dp_ranks": [1]})
            for _ in range(3):  # round robin skips the lost rank
                status, body = http_json(head.url + "/generate", {
                    "input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}})
                assert status == 200 and body["meta_info"]["dp_rank"] == 0, body
            status, body = http_json(head.url + "/generate", {
                "input_ids": PROMPT, "routed_dp_rank": 1, "sampling_params": {"max_new_tokens": 2}})
            assert status == 503, body

            worker = start_node1(tiny_llama_dir, common)  # the node comes back
            _wait_rank_state(head, 1, "active", timeout=90)
            status, body = http_json(head.url + "/generate", {
                "input_ids": PROMPT, "routed_dp_rank": 1, "sampling_params": {"max_new_tokens": 2}})
            assert status == 200 and body["meta_info"]["dp_rank"] == 1, body
            assert http_json(head.url + "/health") == (200, {"status": "ok"})
    finally:
        if worker.poll() is None:
            stop_node(worker)
