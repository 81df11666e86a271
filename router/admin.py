"""Worker administration: `GET /workers` (list), `POST /workers` (add), `DELETE /workers` (remove).

    POST   /workers  {"url": "http://h:p", "role": "prefill"|"decode"|"regular",
                      "bootstrap_port": 8998}          -> 201 with the worker's state
    DELETE /workers?url=http://h:p  (or the same JSON body)  -> 200

A new worker starts *pending* and is checked at once; it takes traffic after its first passed
health check. Roles must match the mode: prefill/decode with --pd-disaggregation, else regular.
"""

from __future__ import annotations

import msgspec
from aiohttp import web

from common.config import ConfigError
from common.server.errors import ApiError, decode_json
from router.config import DEFAULT_BOOTSTRAP_PORT, check_worker_url
from router.state import STATE, RouterState
from router.workers import Role


class AddWorker(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    url: str
    role: str | None = None
    bootstrap_port: int | None = DEFAULT_BOOTSTRAP_PORT


class RemoveWorker(msgspec.Struct, kw_only=True):
    url: str


def _require_admin(state: RouterState) -> None:
    if state.args.api_key is None:
        raise ApiError("worker administration is disabled: start the router with --api-key",
                       None, 403)


async def handle_list_workers(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return web.json_response({
        "mode": "pd" if state.pd else "plain",
        "workers": [w.describe() for w in state.registry.all()],
    })


async def handle_add_worker(request: web.Request) -> web.Response:
    state = request.app[STATE]
    _require_admin(state)
    body = decode_json(await request.read(), AddWorker)
    allowed = ("prefill", "decode") if state.pd else ("regular",)
    role = body.role or ("regular" if not state.pd else None)
    if role not in allowed:
        raise ApiError(f"role must be one of {allowed} in this mode (got {body.role!r})", "role")
    try:
        check_worker_url(body.url)
    except ConfigError as exc:
        raise ApiError(str(exc), "url") from None
    if body.bootstrap_port is not None and not 0 < body.bootstrap_port < 65536:
        raise ApiError("bootstrap_port must be in [1, 65535]", "bootstrap_port")
    try:
        worker = state.registry.add(body.url, Role(role),
                                    body.bootstrap_port if role == "prefill" else None)
    except ValueError as exc:
        raise ApiError(str(exc), "url", 409) from None
    return web.json_response(worker.describe(), status=201)


async def handle_remove_worker(request: web.Request) -> web.Response:
    state = request.app[STATE]
    _require_admin(state)
    url = request.query.get("url")
    if url is None:
        url = decode_json(await request.read(), RemoveWorker).url
    try:
        worker = state.registry.remove(url)
    except KeyError:
        raise ApiError(f"no worker {url!r} is registered", "url", 404) from None
    return web.json_response({"removed": worker.describe()})
