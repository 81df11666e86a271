"""The prefill service's bootstrap server: where prefill DP ranks register and decode asks
for the prefill topology (SPEC section 4).

Lifecycle: the launcher starts it (its own thread and event loop) before the schedulers, so
each rank can register (`PUT /route`) as soon as its KV endpoint is bound. Until every started
rank has registered, `GET /route` answers 503 (decode retries); afterwards it returns the
topology: the slot count that rooms are taken modulo (reserved slots included, exactly as the
prefill DP controller counts them), the transfer backend and each rank's endpoint and KV
layout. A re-registration (a restarted rank) replaces the old entry.
"""

from __future__ import annotations

import asyncio
import logging
import threading

import msgspec
from aiohttp import web

from common.messages.kv_bootstrap import PrefillTopology, RankRegistration

logger = logging.getLogger(__name__)


class RegistryError(ValueError):
    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


class BootstrapRegistry:
    """Pure bookkeeping behind the HTTP routes."""

    def __init__(self, num_dp_slots: int, expected_ranks: set[int]):
        self.num_dp_slots = num_dp_slots
        self.expected = set(expected_ranks)
        self.transfer_backend: str | None = None  # the first rank's; every rank must agree
        self.ranks: dict[int, RankRegistration] = {}
        self._lock = threading.Lock()

    def register(self, reg: RankRegistration) -> None:
        if not 0 <= reg.dp_rank < self.num_dp_slots:
            raise RegistryError(
                f"dp_rank {reg.dp_rank} is out of range [0, {self.num_dp_slots})", 400)
        with self._lock:
            if self.transfer_backend not in (None, reg.transfer_backend):
                raise RegistryError(f"rank {reg.dp_rank} uses transfer backend "
                                    f"{reg.transfer_backend}, the others "
                                    f"{self.transfer_backend}", 400)
            self.transfer_backend = reg.transfer_backend
            for other in self.ranks.values():
                if other.dp_rank != reg.dp_rank and _layout(other) != _layout(reg):
                    raise RegistryError(f"rank {reg.dp_rank}'s KV layout {_layout(reg)} differs "
                                        f"from rank {other.dp_rank}'s {_layout(other)}", 400)
            self.ranks[reg.dp_rank] = reg
            self.expected.add(reg.dp_rank)
        logger.info("prefill rank %d registered at %s", reg.dp_rank, reg.control_endpoint)

    def expect(self, rank: int) -> None:
        with self._lock:
            self.expected.add(rank)

    def forget(self, rank: int) -> None:
        """A rank that died or was removed: queries for it answer 503 until it re-registers."""
        with self._lock:
            self.ranks.pop(rank, None)
            self.expected.discard(rank)

    def topology(self) -> PrefillTopology:
        with self._lock:
            missing = sorted(self.expected - set(self.ranks))
            if missing or not self.ranks:
                raise RegistryError(f"prefill ranks {missing} have not registered yet", 503)
            return PrefillTopology(num_dp_slots=self.num_dp_slots,
                                   transfer_backend=self.transfer_backend,
                                   ranks=dict(self.ranks))

    def rank(self, raw: str) -> RankRegistration:
        try:
            rank = int(raw)
        except ValueError:
            raise RegistryError(f"prefill_dp_rank must be an integer, got {raw!r}", 400) from None
        if not 0 <= rank < self.num_dp_slots:
            raise RegistryError(
                f"prefill_dp_rank {rank} is out of range [0, {self.num_dp_slots})", 404)
        with self._lock:
            reg = self.ranks.get(rank)
        if reg is None:
            raise RegistryError(f"prefill rank {rank} has not registered", 503)
        return reg


def _layout(reg: RankRegistration) -> tuple:
    return (reg.num_layers, reg.page_size, reg.num_kv_heads, reg.head_dim, reg.dtype)


def _error(message: str, status: int) -> web.Response:
    return web.json_response({"error": {"message": message, "code": status}}, status=status)


def create_bootstrap_app(registry: BootstrapRegistry) -> web.Application:
    async def put_route(request: web.Request) -> web.Response:
        try:
            reg = msgspec.json.decode(await request.read(), type=RankRegistration)
            registry.register(reg)
        except msgspec.ValidationError as exc:
            return _error(f"invalid registration: {exc}", 400)
        except msgspec.DecodeError as exc:
            return _error(f"the body is not valid JSON: {exc}", 400)
        except RegistryError as exc:
            return _error(str(exc), exc.status)
        return web.json_response({"registered": reg.dp_rank})

    async def get_route(request: web.Request) -> web.Response:
        unknown = set(request.query) - {"prefill_dp_rank"}
        if unknown:
            return _error(f"unknown query parameters {sorted(unknown)}", 400)
        try:
            if "prefill_dp_rank" in request.query:
                result = registry.rank(request.query["prefill_dp_rank"])
            else:
                result = registry.topology()
        except RegistryError as exc:
            return _error(str(exc), exc.status)
        return web.Response(body=msgspec.json.encode(result), content_type="application/json")

    async def health(_request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.router.add_put("/route", put_route)
    app.router.add_get("/route", get_route)
    app.router.add_get("/health", health)
    return app


class BootstrapServer:
    """Runs the bootstrap app on its own thread and event loop (the launcher is still blocking
    on start-up while ranks register)."""

    def __init__(self, registry: BootstrapRegistry, host: str, port: int):
        self.registry = registry
        self.host, self.port = host, port
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="bootstrap-server", daemon=True)

    def start(self) -> None:
        self._thread.start()
        self._started.wait()
        if self._error is not None:
            raise RuntimeError(f"the bootstrap server could not listen on port {self.port}: "
                               f"{self._error}")
        logger.info("bootstrap server on %s:%d", self.host, self.port)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._runner = web.AppRunner(create_bootstrap_app(self.registry), access_log=None)
            self._loop.run_until_complete(self._runner.setup())
            self._loop.run_until_complete(web.TCPSite(self._runner, self.host, self.port).start())
        except OSError as exc:
            self._error = exc
            self._started.set()
            return
        self._started.set()
        self._loop.run_forever()
        self._loop.run_until_complete(self._runner.cleanup())
        self._loop.close()

    def stop(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
