"""`make demo`: the whole PD stack on the embedded SmolLM2-135M-Instruct.

Starts `pdserve prefill` (dp 2), `pdserve decode` (dp 2) and `pdserve router` in front of
them, asks one question through the router, prints the answer and which prefill and decode DP
ranks served it, then stops everything (also on Ctrl-C or failure).
"""

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


def post(url: str, body: dict) -> tuple[dict, dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        return json.loads(resp.read()), dict(resp.headers)


def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read())


def wait_ready(name: str, url: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{name} exited during start-up (code {proc.returncode})")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise SystemExit(f"{name} did not become ready in time")


def start(name: str, args: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "common.cli", *args]
    print(f"starting {name}: pdserve {' '.join(args)}", flush=True)
    return subprocess.Popen(cmd, start_new_session=True)


def stop(procs: list[tuple[str, subprocess.Popen]]) -> None:
    for _, proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for name, proc in procs:
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)
        print(f"{name} stopped (exit code {proc.returncode})")


def main() -> int:
    print("preparing the embedded model (converted once, then cached) ...", flush=True)
    model = subprocess.run([sys.executable, "-m", "common.cli", "prepare-model"], check=True,
                           capture_output=True, text=True).stdout.strip()
    prefill_port, decode_port, router_port, bootstrap = (free_port() for _ in range(4))
    common = ["--max-total-tokens", "8192", "--dp-size", "2", "--log-level", "warning"]
    procs: list[tuple[str, subprocess.Popen]] = []
    try:
        procs.append(("prefill", start("prefill", [
            "prefill", "--port", str(prefill_port), "--disaggregation-bootstrap-port",
            str(bootstrap), *common])))
        procs.append(("decode", start("decode", ["decode", "--port", str(decode_port),
                                                 *common])))
        for name, port in (("prefill", prefill_port), ("decode", decode_port)):
            wait_ready(name, f"http://127.0.0.1:{port}/health", dict(procs)[name])
        procs.append(("router", start("router", [
            "router", "--port", str(router_port), "--pd-disaggregation",
            "--prefill", f"http://127.0.0.1:{prefill_port}", str(bootstrap),
            "--decode", f"http://127.0.0.1:{decode_port}", "--log-level", "warning"])))
        router = f"http://127.0.0.1:{router_port}"
        wait_ready("router", router + "/readiness", procs[-1][1])

        # /generate on the chat-formatted prompt, so the answer carries meta_info.dp_rank
        from common.engine.tokenizer import Tokenizer

        prompt = Tokenizer.from_model_path(model).apply_chat_template(
            [{"role": "user", "content": QUESTION}], add_generation_prompt=True)
        answer, headers = post(router + "/generate", {
            "text": prompt, "sampling_params": {"max_new_tokens": 32, "temperature": 0}})
        room = int(headers["X-PD-Bootstrap-Room"])
        slots = get(f"http://127.0.0.1:{prefill_port}/v1/loads")["num_dp_slots"]
        print(f"\nQ: {QUESTION}\nA: {answer['text'].strip()}")
        print(f"   prefill {headers['X-PD-Prefill']} rank {room % slots} "
              f"(bootstrap_room {room} % {slots}), decode http://127.0.0.1:{decode_port} "
              f"rank {answer['meta_info']['dp_rank']}\n", flush=True)
    finally:
        stop(list(reversed(procs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
