"""The service tree starts and stops as one unit: clear start-up errors, a dead child takes the
service down (never a hang), SIGTERM drains in-flight requests, nothing is left behind."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

from server_utils import ServerProcess, http_json

LONG_TOKENS = 300
LONG = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": LONG_TOKENS,
                                                    "temperature": 0, "ignore_eos": True}}
LONG_FLAGS = ("--max-total-tokens", "4096", "--context-length", "4096")


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "common.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is as good as gone
        return f.read().split()[2] != "Z"


def child_pids(server: ServerProcess) -> list[int]:
    status, info = http_json(server.url + "/get_server_info")
    assert status == 200
    return list(info["process_pids"].values())


def all_gone(pids: list[int], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while any(pid_alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def wait_running(server: ServerProcess, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while server.stats()["num_running_reqs"] == 0:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.02)


def test_bad_flag_is_a_clear_error():
    result = run_cli("serve", "--page-size", "0")
    assert result.returncode == 2
    assert "--page-size must be >= 1" in result.stderr


def test_missing_model_folder_is_a_clear_error(tmp_path):
    result = run_cli("serve", "--model-path", str(tmp_path / "nope"), "--port", "1")
    assert result.returncode == 2
    assert "is not a folder" in result.stderr


def test_unsupported_architecture_is_a_clear_error(tmp_path, tiny_llama_dir):
    folder = tmp_path / "gpt2"
    shutil.copytree(tiny_llama_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (folder / "config.json").write_text(json.dumps(config))
    result = run_cli("serve", "--model-path", str(folder), "--port", "1")
    assert result.returncode == 1
    assert "GPT2LMHeadModel" in result.stderr and "LlamaForCausalLM" in result.stderr


def test_dead_scheduler_takes_the_service_down(tiny_llama_dir):
    server = ServerProcess(tiny_llama_dir, *LONG_FLAGS)
    with server:
        pids = http_json(server.url + "/get_server_info")[1]["process_pids"]
        children = list(pids.values())
        result: dict = {}

        def long_request() -> None:
            result["reply"] = http_json(server.url + "/generate", LONG, timeout=30)

        thread = threading.Thread(target=long_request)
        thread.start()
        wait_running(server)
        os.kill(pids["scheduler-0"], signal.SIGKILL)
        thread.join(20)
        assert not thread.is_alive(), "the in-flight request hung"
        status, body = result["reply"]
        assert status == 503 and "scheduler-0 process" in body["error"]["message"]
        server.proc.wait(20)
        assert server.proc.returncode == 1
        assert "scheduler-0 process" in server.log_text() and "died" in server.log_text()
        assert all_gone(children)


def test_sigterm_drains_in_flight_requests(tiny_llama_dir):
    server = ServerProcess(tiny_llama_dir, *LONG_FLAGS, "--graceful-shutdown-timeout", "120")
    with server:
        children = child_pids(server)
        result: dict = {}
        thread = threading.Thread(
            target=lambda: result.setdefault("reply", http_json(server.url + "/generate", LONG))
        )
        thread.start()
        wait_running(server)
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.1)
        status, body = http_json(server.url + "/health")
        assert status == 503
        thread.join(60)
        status, body = result["reply"]
        assert status == 200 and body["meta_info"]["completion_tokens"] == LONG_TOKENS
        assert server.proc.wait(20) == 0
        assert all_gone(children)


def test_sigterm_aborts_what_outlives_the_drain_timeout(tiny_llama_dir):
    server = ServerProcess(tiny_llama_dir, "--max-total-tokens", "20000", "--context-length",
                           "20000", "--graceful-shutdown-timeout", "0.5")
    endless = {"input_ids": [5], "sampling_params": {"max_new_tokens": 19000, "temperature": 0,
                                                     "ignore_eos": True}}
    with server:
        result: dict = {}
        thread = threading.Thread(
            target=lambda: result.setdefault("reply", http_json(server.url + "/generate", endless))
        )
        thread.start()
        wait_running(server)
        started = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(20) == 0
        assert time.monotonic() - started < 10
        thread.join(10)
        status, body = result["reply"]
        assert status == 503 and "shutting down" in body["error"]["message"]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_idle_service_stops_cleanly(tiny_llama_dir, sig):
    server = ServerProcess(tiny_llama_dir, "--max-total-tokens", "1024")
    with server:
        children = child_pids(server)
        board = http_json(server.url + "/get_server_info")[1]["load_board"]
        assert os.path.exists(board)
        server.proc.send_signal(sig)
        assert server.proc.wait(20) == 0
    assert all_gone(children)
    assert not os.path.exists(board), "the load board is removed on shutdown"
