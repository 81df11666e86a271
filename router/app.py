"""The router's aiohttp application: middleware, inference routes, and the route table.

Every request passes one middleware that (1) fixes the request id: `X-Request-Id` if the client
sent one, else the body's `rid` (inference routes), else a fresh uuid4 hex; it comes back in the
`X-Request-Id` response header and goes upstream as `rid` (see `request_plan.py`); (2) checks
`--api-key` (see `auth.py`); (3) turns errors into OpenAI-shaped JSON (`common/server/errors.py`);
(4) counts the request in `/metrics`.
"""

from __future__ import annotations

import logging
import time
import uuid

import msgspec
from aiohttp import web

from common.server.errors import ApiError, error_response, handle_errors
from router import admin, info_api
from router.auth import OPEN_PATHS, is_authorized
from router.dispatch import dispatch_pd, dispatch_plain
from router.request_plan import CHAT, COMPLETIONS, GENERATE, add_rid, plan_request
from router.state import STATE, RouterState

logger = logging.getLogger(__name__)
INFERENCE = {"/generate": GENERATE, "/v1/completions": COMPLETIONS,
             "/v1/chat/completions": CHAT}


@web.middleware
async def router_middleware(request: web.Request, handler):
    state: RouterState = request.app[STATE]
    given = request.headers.get("X-Request-Id")
    request["request_id_given"] = given is not None
    request["request_id"] = given or uuid.uuid4().hex
    started = time.perf_counter()
    if request.path not in OPEN_PATHS and not is_authorized(
            state.args.api_key, request.headers.get("Authorization")):
        response = error_response("missing or invalid API key (Authorization: Bearer <key>)",
                                  None, 401)
        response.headers["WWW-Authenticate"] = "Bearer"
    else:
        response = await handle_errors(request, handler)
    if not response.prepared:
        response.headers.setdefault("X-Request-Id", request["request_id"])
    resource = request.match_info.route.resource
    route = resource.canonical if resource is not None else "unmatched"
    state.metrics.count_request(route, response.status,
                                time.perf_counter() - started if route in INFERENCE else None)
    return response


def inference_handler(route: str, path: str):
    async def handle(request: web.Request) -> web.StreamResponse:
        state: RouterState = request.app[STATE]
        raw = await request.read()
        if not raw.strip():
            raise ApiError("request body is empty; expected a JSON object")
        try:
            body = msgspec.json.decode(raw)
        except msgspec.DecodeError as exc:
            raise ApiError(f"malformed JSON body: {exc}") from None
        plan = plan_request(route, body)
        request_id = request["request_id"]
        if not request["request_id_given"] and isinstance(body.get("rid"), str):
            request_id = request["request_id"] = body["rid"]
        add_rid(plan, request_id)
        dispatch = dispatch_pd if state.pd else dispatch_plain
        return await dispatch(state, request, plan, path, request_id)

    return handle


def create_app(state: RouterState) -> web.Application:
    app = web.Application(middlewares=[router_middleware],
                          client_max_size=state.args.max_payload_size)
    app[STATE] = state
    for path, route in INFERENCE.items():
        app.router.add_post(path, inference_handler(route, path))
    app.router.add_get("/v1/models", info_api.handle_models)
    app.router.add_get("/get_model_info", info_api.handle_model_info)
    app.router.add_get("/get_server_info", info_api.handle_server_info)
    app.router.add_get("/v1/loads", info_api.handle_loads)
    app.router.add_get("/health", info_api.handle_readiness)
    app.router.add_get("/readiness", info_api.handle_readiness)
    app.router.add_get("/liveness", info_api.handle_liveness)
    app.router.add_get("/metrics", info_api.handle_metrics)
    app.router.add_get("/workers", admin.handle_list_workers)
    app.router.add_post("/workers", admin.handle_add_worker)
    app.router.add_delete("/workers", admin.handle_remove_worker)

    async def start(_app: web.Application) -> None:
        await state.start()

    async def stop(_app: web.Application) -> None:
        await state.stop()

    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    return app
