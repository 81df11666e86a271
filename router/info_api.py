"""The router's own routes besides inference: health, readiness, models, info, loads, metrics.

* `/liveness`: the router process answers (always 200).
* `/readiness` and `/health`: 200 when requests can be served (PD: at least one available
  prefill and one available decode worker; plain: one worker), else 503 naming what is missing.
* `/v1/models`, `/get_model_info`: answered by an available worker (decode first: it holds the
  answer side of the model), passed through unchanged.
* `/get_server_info`: the router's settings and worker states, plus each worker's own
  `/get_server_info` under `prefill` / `decode` / `workers_info` (SGLang's PD router shape).
* `/v1/loads`: every worker's `/v1/loads` (its per-DP-rank snapshots and aggregate, or the error
  that kept it from answering), and sums per role.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
import msgspec
from aiohttp import web

from common.server.errors import error_response
from common.server.loads_api import SUMMED
from router.state import STATE, RouterState
from router.workers import Role, Worker

INFO_TIMEOUT_S = 5.0


def _roles(state: RouterState) -> tuple[Role, ...]:
    return (Role.PREFILL, Role.DECODE) if state.pd else (Role.REGULAR,)


def readiness_problem(state: RouterState) -> str | None:
    for role in _roles(state):
        if not state.registry.available(role):
            return state.unavailable_message(role)
    return None


def _counts(state: RouterState) -> dict:
    return {role.value: {"registered": len(state.registry.by_role[role]),
                         "available": len(state.registry.available(role))}
            for role in _roles(state)}


async def handle_liveness(request: web.Request) -> web.Response:
    return web.json_response({"status": "alive"})


async def handle_readiness(request: web.Request) -> web.Response:
    state = request.app[STATE]
    problem = readiness_problem(state)
    if problem is not None:
        return error_response(problem, None, 503)
    return web.json_response({"status": "ok", "workers": _counts(state)})


async def _get_json(state: RouterState, worker: Worker, path: str):
    async with state.session.get(worker.url + path,
                                 timeout=aiohttp.ClientTimeout(total=INFO_TIMEOUT_S)) as resp:
        body = await resp.read()
        if resp.status != 200:
            raise RuntimeError(f"{path} answered {resp.status}: {body[:200]!r}")
        return msgspec.json.decode(body)


async def _gather(state: RouterState, workers: list[Worker], path: str) -> list:
    async def one(worker: Worker):
        try:
            return await _get_json(state, worker, path)
        except (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError,
                msgspec.DecodeError) as exc:
            return {"error": str(exc) or type(exc).__name__}
    return await asyncio.gather(*(one(w) for w in workers))


def _model_worker(state: RouterState) -> Worker | None:
    for role in (Role.DECODE, Role.PREFILL, Role.REGULAR):
        available = state.registry.available(role)
        if available:
            return available[0]
    return None


async def _proxy_get(request: web.Request, path: str) -> web.Response:
    state = request.app[STATE]
    worker = _model_worker(state)
    if worker is None:
        return error_response("no worker is available to answer " + path, None, 503)
    try:
        async with state.session.get(worker.url + path, timeout=aiohttp.ClientTimeout(
                total=INFO_TIMEOUT_S)) as resp:
            return web.Response(body=await resp.read(), status=resp.status,
                                content_type="application/json")
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        return error_response(f"worker {worker.url} did not answer {path}: {exc}", None, 502)


async def handle_models(request: web.Request) -> web.Response:
    return await _proxy_get(request, "/v1/models")


async def handle_model_info(request: web.Request) -> web.Response:
    return await _proxy_get(request, "/get_model_info")


async def handle_server_info(request: web.Request) -> web.Response:
    state = request.app[STATE]
    out = {
        "router": state.args.to_dict(),
        "mode": "pd" if state.pd else "plain",
        "policies": {role.value: state.policies[role].name for role in _roles(state)},
        "workers": [w.describe() for w in state.registry.all()],
    }
    for role in _roles(state):
        workers = state.registry.by_role[role]
        infos = await _gather(state, workers, "/get_server_info")
        name = role.value if state.pd else "workers_info"
        out[name] = [{"url": w.url, **info} for w, info in zip(workers, infos)]
    return web.json_response(out)


async def handle_loads(request: web.Request) -> web.Response:
    state = request.app[STATE]
    workers = state.registry.all()
    replies = await _gather(state, workers, "/v1/loads")
    entries, totals = [], {}
    for worker, reply in zip(workers, replies):
        entry = {"url": worker.url, "role": worker.role.value, "health": worker.health.value}
        entry.update(reply)
        entries.append(entry)
        aggregate = reply.get("aggregate")
        if isinstance(aggregate, dict):
            sums = totals.setdefault(worker.role.value, {f: 0 for f in SUMMED})
            for field in SUMMED:
                sums[field] += aggregate.get(field, 0)
    for sums in totals.values():
        used, capacity = sums["num_used_tokens"], sums["max_total_num_tokens"]
        sums["token_usage"] = used / capacity if capacity else 0.0
    return web.json_response({"timestamp": time.time(), "workers": entries,
                              "aggregate": totals})


async def handle_metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return web.Response(body=state.metrics.exposition(),
                        headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})
