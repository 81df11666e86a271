"""Our prefill and decode services behind SGLang's own router (`sglang-router` from PyPI) in
PD mode: users can keep the router they already run. Greedy answers equal a colocated
service's on /generate, completions and chat, streaming included."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

import pytest

from server_utils import free_port, http_json


@pytest.fixture(scope="module")
def sglang_router(pd_tcp):
    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="sglang-router-", suffix=".log", delete=False)
    proc = subprocess.Popen(
        [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
         "--prefill", pd_tcp.prefill.url, str(pd_tcp.bootstrap_port),
         "--decode", pd_tcp.decode.url, "--host", "127.0.0.1", "--port", str(port),
         "--policy", "round_robin"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, open(log.name).read()[-3000:]
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, open(log.name).read()[-3000:]
            time.sleep(0.2)
        yield pd_tcp, url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


def _answer(out):
    if "choices" in out:
        return [c.get("text") or c.get("message") for c in out["choices"]]
    return out["output_ids"]


@pytest.mark.parametrize("path,body", [
    ("/generate", {"input_ids": list(range(5, 45)),
                   "sampling_params": {"max_new_tokens": 8, "temperature": 0}}),
    ("/generate", {"text": "hello world",
                   "sampling_params": {"max_new_tokens": 8, "temperature": 0}}),
    ("/v1/completions", {"model": "tiny", "prompt": "hello world", "max_tokens": 8,
                         "temperature": 0}),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                              "max_tokens": 8, "temperature": 0}),
])
def test_requests_through_sglang_router(sglang_router, path, body):
    pd, url = sglang_router
    _, want = http_json(pd.colocated.url + path, body)
    status, got = http_json(url + path, body)
    assert status == 200, got
    assert _answer(got) == _answer(want)


def test_streaming_through_sglang_router(sglang_router):
    pd, url = sglang_router
    body = {"text": "hello world", "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    _, want = http_json(pd.colocated.url + "/generate", body)
    req = urllib.request.Request(url + "/generate", json.dumps({**body, "stream": True}).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        lines = [line.decode().strip() for line in resp]
    events = [json.loads(line[6:]) for line in lines
              if line.startswith("data: ") and line != "data: [DONE]"]
    assert lines[-2:] == ["data: [DONE]", ""] or "data: [DONE]" in lines
    assert events[-1]["output_ids"] == want["output_ids"]
    for server in (pd.prefill, pd.decode):
        stats = server.wait_pool_whole()
        assert stats["num_free_pages"] == stats["num_total_pages"]
