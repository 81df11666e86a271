"""Run a real `pdserve serve` process tree for a test: free port, wait for health, always stop.

    with ServerProcess(model_dir, "--page-size", "1") as server:
        requests go to server.url
    # the process group is gone here, even if the test failed

Output goes to a log file whose tail is printed if start-up fails.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

START_TIMEOUT = 120.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_block(size: int) -> int:
    """A port p such that p .. p + size - 1 are all free right now."""
    for _ in range(100):
        base = free_port()
        if base + size >= 65536:
            continue
        socks = []
        try:
            for port in range(base, base + size):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no block of free ports found")


def http_json(url: str, body: object | None = None, timeout: float = 60.0) -> tuple[int, object]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


class ServerProcess:
    def __init__(self, model_dir: str | Path | None, *extra_args: str, env: dict | None = None,
                 command: str = "serve"):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [sys.executable, "-m", "common.cli", command, "--port", str(self.port)]
        if model_dir is not None:
            self.args += ["--model-path", str(model_dir)]
        self.args += list(extra_args)
        self.env = {**os.environ, **(env or {})}
        self.log = tempfile.NamedTemporaryFile(prefix="pdserve-test-", suffix=".log", delete=False)
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> ServerProcess:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        self.proc = subprocess.Popen(
            self.args, stdout=self.log, stderr=subprocess.STDOUT, env=self.env,
            start_new_session=True,
        )
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_text()}")
            try:
                status, _ = http_json(self.url + "/health", timeout=2)
                if status == 200:
                    return
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server did not become healthy:\n{self.log_text()}")

    def log_text(self) -> str:
        return Path(self.log.name).read_text(errors="replace")[-5000:]

    def stop(self, timeout: float = 20.0) -> int | None:
        """SIGTERM, then SIGKILL of the whole process group; returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(5)
        return self.proc.returncode

    def stats(self) -> dict:
        status, info = http_json(self.url + "/get_server_info")
        assert status == 200, info
        return info["internal_states"][0]

    def pool_stats(self) -> dict:
        """Every scheduler's counters (free/total KV pages, queues) summed over the DP ranks."""
        status, info = http_json(self.url + "/get_server_info")
        assert status == 200, info
        ranks = info["internal_states"]
        summed = {key: sum(r[key] for r in ranks) for key in
                  ("num_free_pages", "num_total_pages", "num_running_reqs", "num_waiting_reqs")}
        return {**summed, "ranks": ranks}

    def wait_pool_whole(self, timeout: float = 10.0) -> dict:
        """Waits until every KV page of every DP rank is free again (aborts are
        asynchronous)."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.pool_stats()
            if stats["num_free_pages"] == stats["num_total_pages"] or time.monotonic() > deadline:
                return stats
            time.sleep(0.05)
