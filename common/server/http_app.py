"""The aiohttp application of one service: routes, error handling, health and admin.

Every failure a client can cause becomes a JSON error from `errors.py` (4xx naming the
field); an unexpected exception is logged and answered 500 without touching other requests.
"""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec
from aiohttp import web

from common.messages.sampling import SamplingParams
from common.messages.scheduler_input import GenerateRequest
from common.server.context import CTX, ServerContext
from common.server.errors import ApiError, decode_json, error_response, handle_errors
from common.server.generate_api import handle_generate
from common.server.loads_api import (
    handle_change_rank,
    handle_list_ranks,
    handle_loads,
    handle_metrics,
)
from common.server.openai_api import handle_chat, handle_completions, handle_models

logger = logging.getLogger(__name__)

HEALTH_GENERATE_TIMEOUT = 20.0


@web.middleware
async def error_middleware(request: web.Request, handler):
    response = await handle_errors(request, handler)
    metrics = request.app[CTX].metrics
    if metrics is not None:
        route = request.match_info.route.resource
        name = route.canonical if route is not None else "unmatched"
        metrics.http_requests.labels(name, str(response.status)).inc()
    return response


async def handle_health(request: web.Request) -> web.Response:
    ctx: ServerContext = request.app[CTX]
    if ctx.unhealthy_reason is not None:
        return error_response(ctx.unhealthy_reason, None, 503)
    if ctx.draining:
        return error_response("shutting down", None, 503)
    if ctx.dp is not None and ctx.dp.unavailable:
        if not ctx.dp.available:
            return error_response("no DP rank is available", None, 503)
        return web.json_response({"status": "degraded", "unavailable_dp_ranks": ctx.dp.unavailable})
    return web.json_response({"status": "ok"})


async def handle_health_generate(request: web.Request) -> web.Response:
    """Runs a one-token generation through the whole tree. A PD side cannot generate alone
    (a request needs its peer), so there every scheduler must answer a stats round trip."""
    ctx: ServerContext = request.app[CTX]
    ctx.check_accepting()
    if ctx.args.disaggregation_mode != "null":
        try:
            await asyncio.wait_for(ctx.frontend.stats(), HEALTH_GENERATE_TIMEOUT)
        except (RuntimeError, asyncio.TimeoutError) as exc:
            return error_response(f"schedulers did not answer: {exc}", None, 503)
        return web.json_response({"status": "ok"})
    req = GenerateRequest(
        rid=f"health-{ctx.new_rid()}",
        input_ids=[ctx.tokenizer.bos_token_id or 0],
        sampling=SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True),
    )

    async def run() -> None:
        async for out in ctx.frontend.generate(req):
            if out.finished and out.finish_reason and out.finish_reason.status:
                raise ApiError(out.finish_reason.message or "generation failed", None, 503)

    try:
        await asyncio.wait_for(run(), HEALTH_GENERATE_TIMEOUT)
    except asyncio.TimeoutError:
        return error_response("health generation timed out", None, 503)
    return web.json_response({"status": "ok"})


async def handle_server_info(request: web.Request) -> web.Response:
    """SGLang's shape: every flag at the top level, with what the service resolved taking the
    place of "auto"/unset values (device, dtype, context_length, max_total_tokens,
    load_balance_method ...); the flags exactly as given are under `server_args`."""
    ctx: ServerContext = request.app[CTX]
    flags = ctx.args.to_dict()
    info = {**flags, "server_args": flags}
    info["model_path"] = ctx.model_path
    info["served_model_name"] = ctx.model_name
    resolved = msgspec.to_builtins(ctx.info)
    resolved.pop("type", None)  # the message tag, not a value
    info.update(resolved)
    info["process_pids"] = ctx.process_pids()
    if ctx.dp is not None:
        info["load_balance_method"] = ctx.dp.method  # the resolved method, not "auto"
        info["dp_rank_states"] = [s.value for s in ctx.dp.states]
        info["load_board"] = ctx.dp.board.path
    try:
        info["internal_states"] = [msgspec.to_builtins(s) for s in await ctx.frontend.stats()]
    except (RuntimeError, asyncio.TimeoutError) as exc:
        info["internal_states"] = [{"error": str(exc)}]
    info["version"] = _version()
    return web.json_response(info)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pdserve")
    except PackageNotFoundError:
        return "unknown"


async def handle_model_info(request: web.Request) -> web.Response:
    ctx: ServerContext = request.app[CTX]
    return web.json_response({
        "model_path": ctx.model_path,
        "served_model_name": ctx.model_name,
        "architecture": ctx.info.architecture,
        "is_generation": True,
        "context_length": ctx.info.context_length,
        "vocab_size": ctx.info.vocab_size,
        "has_chat_template": ctx.tokenizer.has_chat_template,
    })


class AbortBody(msgspec.Struct, kw_only=True):
    rid: str


async def handle_abort(request: web.Request) -> web.Response:
    ctx: ServerContext = request.app[CTX]
    body = decode_json(await request.read(), AbortBody)
    if not ctx.frontend.is_inflight(body.rid):
        raise ApiError(f"no request with rid {body.rid!r} is in flight", "rid", 404)
    ctx.frontend.abort(body.rid)
    return web.json_response({"status": "ok", "rid": body.rid})


async def handle_flush_cache(request: web.Request) -> web.Response:
    ctx: ServerContext = request.app[CTX]
    try:
        results = await ctx.frontend.flush_cache()
    except (RuntimeError, asyncio.TimeoutError) as exc:
        return error_response(f"flush failed: {exc}", None, 503)
    failed = [r for r in results if not r.success]
    if failed:
        return error_response(
            "; ".join(f"DP rank {r.dp_rank}: {r.message}" for r in failed), None, 409
        )
    return web.json_response({"status": "ok", "message": results[0].message if results else ""})


def create_app(ctx: ServerContext) -> web.Application:
    app = web.Application(middlewares=[error_middleware], client_max_size=64 * 1024 * 1024)
    app[CTX] = ctx
    ctx.started = time.time()
    app.router.add_post("/generate", handle_generate)
    app.router.add_post("/v1/completions", handle_completions)
    app.router.add_post("/v1/chat/completions", handle_chat)
    app.router.add_get("/v1/models", handle_models)
    app.router.add_get("/health", handle_health)
    app.router.add_get("/health_generate", handle_health_generate)
    app.router.add_get("/get_server_info", handle_server_info)
    app.router.add_get("/get_model_info", handle_model_info)
    app.router.add_post("/abort_request", handle_abort)
    app.router.add_post("/flush_cache", handle_flush_cache)
    app.router.add_get("/v1/loads", handle_loads)
    app.router.add_get("/metrics", handle_metrics)
    app.router.add_get("/dp_ranks", handle_list_ranks)
    app.router.add_post("/dp_ranks/{rank}", handle_change_rank)
    return app
