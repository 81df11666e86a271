"""`make demo`: start pdserve on the embedded SmolLM2-135M-Instruct, ask one question through
the OpenAI chat API, print the answer, and stop the service (also on Ctrl-C or failure)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

QUESTION = "What is the capital of France?"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the service exited during start-up (code {proc.returncode})")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise SystemExit("the service did not become healthy in time")


def main() -> int:
    print("preparing the embedded model (converted once, then cached) ...", flush=True)
    subprocess.run([sys.executable, "-m", "common.cli", "prepare-model"], check=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "common.cli", "serve", "--port", str(port),
           "--max-total-tokens", "8192", "--log-level", "warning"]
    print("starting:", " ".join(cmd[2:]), flush=True)
    proc = subprocess.Popen(cmd, start_new_session=True)
    try:
        wait_healthy(url, proc)
        answer = post(url + "/v1/chat/completions", {
            "messages": [{"role": "user", "content": QUESTION}],
            "max_tokens": 32,
            "temperature": 0,
        })
        print(f"\nQ: {QUESTION}\nA: {answer['choices'][0]['message']['content']}\n", flush=True)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        print(f"service stopped (exit code {proc.returncode})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
