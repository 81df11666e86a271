"""Two node process groups of one service on this machine (`--nnodes 2`): node 0 runs the
front end, controller, detokenizer and rank 0; node 1 runs rank 1 and reaches node 0 only
through `--dist-init-addr`. Its snapshots are relayed into node 0's board by whichever process
owns the relay: the controller for load-aware methods, the front end otherwise."""

from __future__ import annotations

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


@pytest.mark.parametrize("method", ["total_requests", "round_robin"])
def test_two_nodes_serve_one_service(tiny_llama_dir, method):
    addr = f"127.0.0.1:{free_port_block(4)}"  # detokenizer, relay, one scheduler per rank
    common = ["--dp-size", "2", "--nnodes", "2", "--dist-init-addr", addr,
              "--load-balance-method", method, "--max-total-tokens", "1024"]
    worker = subprocess.Popen(
        [sys.executable, "-m", "common.cli", "serve", "--model-path", str(tiny_llama_dir),
         *common, "--node-rank", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
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
            status, body = http_json(head.url + "/generate", {
                "input_ids": [[1, 2, 3]] * 4, "sampling_params": {"max_new_tokens": 1}})
            assert sorted(b["meta_info"]["dp_rank"] for b in body) == [0, 0, 1, 1]
            status, info = http_json(head.url + "/get_server_info")
            assert [s["dp_rank"] for s in info["internal_states"]] == [0, 1]
    finally:
        worker.terminate()
        try:
            code = worker.wait(20)
        except subprocess.TimeoutExpired:
            worker.kill()
            code = worker.wait(5)
    assert code == 0, worker.stderr.read()[-3000:]
