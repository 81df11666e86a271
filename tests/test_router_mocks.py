"""Test support for the router (no tests here): mock workers and a real router process.

`MockWorker` speaks the worker HTTP API the router uses (`/generate`, `/v1/completions`,
`/v1/chat/completions`, `/health`, `/v1/models`, `/get_server_info`, `/v1/loads`) with
behaviour a test can change at any time (`mode`, `delay_s`, `healthy`, chunk timing, loads)
and records every inference call it receives (`calls`, `aborted`). All mocks of a test run on
one background event loop (`MockFleet`), so tests stay synchronous and a mock never blocks the
router. `python tests/test_router_mocks.py --role decode --port P` runs one mock as its own
process, for tests that SIGSTOP a worker.

`RouterProcess` runs `python -m common.cli router ...` on a free port and always stops it.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parent))
from server_utils import free_port, http_json  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
MODES = ("ok", "fail500", "hang", "stream_error", "drop")


class MockWorker:
    def __init__(self, role: str, port: int | None = None):
        self.role = role
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.mode = "ok"
        self.delay_s = 0.0  # before the answer's headers
        self.chunks = 3  # streamed chunks
        self.chunk_interval_s = 0.0
        self.healthy = True
        self.loads: list[dict] | None = None  # per-rank entries for /v1/loads
        self.num_dp_slots = 1
        self.calls: list[tuple[str, dict]] = []
        self.aborted = 0  # inference requests whose client (the router) went away
        self.runner: web.AppRunner | None = None

    # ---- HTTP --------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application()
        for path in ("/generate", "/v1/completions", "/v1/chat/completions"):
            app.router.add_post(path, self.handle_inference)
        app.router.add_get("/health", self.handle_health)
        app.router.add_get("/v1/models", self.handle_models)
        app.router.add_get("/get_model_info", self.handle_models)
        app.router.add_get("/get_server_info", self.handle_server_info)
        app.router.add_get("/v1/loads", self.handle_loads)
        return app

    async def handle_health(self, request: web.Request) -> web.Response:
        if not self.healthy:
            return web.json_response({"error": {"message": "unhealthy"}}, status=503)
        return web.json_response({"status": "ok"})

    async def handle_models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": f"mock-{self.role}"}]})

    async def handle_server_info(self, request: web.Request) -> web.Response:
        return web.json_response({"role": self.role, "port": self.port})

    async def handle_loads(self, request: web.Request) -> web.Response:
        entries = self.loads or [{"dp_rank": r, "state": "active", "timestamp": time.time(),
                                  "num_running_reqs": 0, "num_waiting_reqs": 0,
                                  "num_total_tokens": 0, "stale": False}
                                 for r in range(self.num_dp_slots)]
        aggregate = {k: sum(e.get(k, 0) for e in entries)
                     for k in ("num_running_reqs", "num_waiting_reqs", "num_total_tokens")}
        return web.json_response({"timestamp": time.time(), "num_dp_slots": len(entries),
                                  "dp_size": len(entries), "loads": entries,
                                  "aggregate": aggregate})

    async def handle_inference(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.calls.append((request.path, body))
        try:
            return await self._answer(request, body)
        except (asyncio.CancelledError, ConnectionResetError):
            self.aborted += 1
            raise

    async def _answer(self, request: web.Request, body: dict) -> web.StreamResponse:
        if self.mode == "hang":
            await asyncio.Event().wait()
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.mode == "fail500":
            return web.json_response({"error": {"message": f"{self.role} exploded",
                                                "type": "server_error", "param": None,
                                                "code": 500}}, status=500)
        items = self.items(body)
        if not body.get("stream"):
            out = [self.item(body, i, final=True) for i in range(items)]
            return web.json_response(out if self._is_batch(body) else out[0])
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        chunks = 1 if self.role == "prefill" else self.chunks
        for k in range(1, chunks + 1):
            if k > 1 and self.chunk_interval_s:
                await asyncio.sleep(self.chunk_interval_s)
            if self.mode == "stream_error":
                await response.write(b'data: {"error": {"message": "kv transfer failed", '
                                     b'"type": "server_error", "param": null, "code": 500}}\n\n')
                break
            if self.mode == "drop":
                request.transport.close()
                return response
            for i in range(items):
                chunk = self.item(body, i, final=k == chunks, length=k)
                if self._is_batch(body):
                    chunk["index"] = i
                await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    @staticmethod
    def _is_batch(body: dict) -> bool:
        return isinstance(body.get("text"), list) or isinstance(body.get("bootstrap_room"), list)

    @staticmethod
    def items(body: dict) -> int:
        rooms = body.get("bootstrap_room")
        if isinstance(rooms, list):
            return len(rooms)
        return len(body["text"]) if isinstance(body.get("text"), list) else 1

    def item(self, body: dict, i: int, final: bool, length: int = 3) -> dict:
        rid = body.get("rid")
        meta = {"id": rid[i] if isinstance(rid, list) and i < len(rid) else rid,
                "finish_reason": {"type": "length", "length": length} if final else None,
                "role": self.role, "worker": self.url, "completion_tokens": length}
        if body.get("return_logprob"):
            meta["input_token_logprobs"] = (
                [[-1.5, 11, None], [-2.5, 12, None]] if self.role == "prefill" else [])
            meta["output_token_logprobs"] = [[-0.5, 7, None]] * length
        return {"text": f"{self.role}:" + "x" * length, "output_ids": [7] * length,
                "meta_info": meta}

    # ---- lifecycle (on the fleet's loop) -------------------------------------------------
    async def start(self) -> None:
        self.runner = web.AppRunner(self.app(), handler_cancellation=True, access_log=None,
                                    shutdown_timeout=0.5)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    def inference_calls(self, path: str | None = None) -> list[dict]:
        return [b for p, b in self.calls if path is None or p == path]


class MockFleet:
    """Mock workers on one event loop in a background thread."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.workers: list[MockWorker] = []

    def run(self, coro, timeout: float = 10.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def add(self, role: str) -> MockWorker:
        worker = MockWorker(role)
        self.run(worker.start())
        self.workers.append(worker)
        return worker

    def stop_worker(self, worker: MockWorker) -> None:
        self.run(worker.stop())

    def start_worker(self, worker: MockWorker) -> None:
        self.run(worker.start())

    def close(self) -> None:
        for worker in self.workers:
            try:
                self.run(worker.stop())
            except Exception:  # noqa: BLE001 - closing everything matters more
                pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


class MockProcess:
    """One mock worker as its own process (to SIGSTOP it)."""

    def __init__(self, role: str):
        self.role = role
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--role", role,
             "--port", str(self.port)], cwd=REPO, start_new_session=True)
        wait_until(lambda: _status(self.url + "/health") == 200, 20, "mock process")

    def pause(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        self.resume()
        self.proc.kill()
        self.proc.wait(5)


def _status(url: str, timeout: float = 1.0) -> int | None:
    try:
        return http_json(url, timeout=timeout)[0]
    except OSError:
        return None


def wait_until(predicate, timeout: float, what: str, interval: float = 0.02):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


FAST_HEALTH = ("--health-check-interval-secs", "0.1", "--health-check-timeout-secs", "0.3",
               "--health-failure-threshold", "2", "--health-success-threshold", "2")


class RouterProcess:
    def __init__(self, *args: str, ready: bool = True):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [sys.executable, "-m", "common.cli", "router", "--port", str(self.port),
                     *args]
        self.wait_ready = ready
        self.log = tempfile.NamedTemporaryFile(prefix="router-test-", suffix=".log",
                                               delete=False)
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> RouterProcess:
        self.proc = subprocess.Popen(self.args, cwd=REPO, stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        path = "/readiness" if self.wait_ready else "/liveness"
        try:
            wait_until(lambda: self.proc.poll() is not None or _status(self.url + path) == 200,
                       30, "the router")
            if self.proc.poll() is not None:
                raise RuntimeError(f"router exited {self.proc.returncode}:\n{self.log_text()}")
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def log_text(self) -> str:
        return Path(self.log.name).read_text(errors="replace")[-5000:]

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)

    def workers(self) -> dict[str, dict]:
        status, body = http_json(self.url + "/workers", timeout=5)
        assert status == 200, body
        return {w["url"]: w for w in body["workers"]}


def post(url: str, body: object, headers: dict | None = None,
         timeout: float = 30.0) -> tuple[int, dict, object]:
    """(status, headers, JSON body) of a POST; errors are answers too."""
    host, _, rest = url.removeprefix("http://").partition("/")
    conn = http.client.HTTPConnection(host, timeout=timeout)
    try:
        conn.request("POST", "/" + rest, body=json.dumps(body).encode(),
                     headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        data = resp.read()
        return resp.status, dict(resp.getheaders()), json.loads(data) if data else None
    finally:
        conn.close()


def stream_events(url: str, body: object, headers: dict | None = None,
                  timeout: float = 30.0):
    """Yields (seconds since the request, event payload: dict or "[DONE]") as they arrive;
    first yields ("status", status, headers)."""
    host, _, rest = url.removeprefix("http://").partition("/")
    conn = http.client.HTTPConnection(host, timeout=timeout)
    started = time.monotonic()
    try:
        conn.request("POST", "/" + rest, body=json.dumps(body).encode(),
                     headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        yield ("status", resp.status, dict(resp.getheaders()))
        if resp.status != 200:
            yield (time.monotonic() - started, json.loads(resp.read()))
            return
        while True:
            line = resp.readline()
            if not line:
                return
            line = line.strip()
            if not line.startswith(b"data: "):
                continue
            payload = line[6:]
            yield (time.monotonic() - started,
                   "[DONE]" if payload == b"[DONE]" else json.loads(payload))
    finally:
        conn.close()


def _main() -> None:
    parser = argparse.ArgumentParser(description="one mock worker process")
    parser.add_argument("--role", required=True)
    parser.add_argument("--port", type=int, required=True)
    ns = parser.parse_args()
    worker = MockWorker(ns.role, ns.port)
    web.run_app(worker.app(), host="127.0.0.1", port=ns.port, print=None, access_log=None,
                handler_cancellation=True)


if __name__ == "__main__":
    _main()
