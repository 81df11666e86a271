"""Sending one inference request to its workers: PD dual dispatch, and plain mode.

PD, per request (SPEC section 4):
    pick prefill + decode -> rooms and bootstrap fields -> both legs sent concurrently
    -> the decode answer goes back to the client (streamed as it arrives, or whole)
The prefill leg only has to succeed: its body is drained (or read for prompt logprobs) and
dropped. Whichever leg fails first decides the answer; the other one is cancelled (its
connection closed, which makes the worker abort the request) and is not charged.

Retries: a leg whose connection was refused never reached its worker, so it is sent again to
another worker of the same role after a backoff (up to `--retry-max-retries` attempts). This is
done for the decode leg (its prefill partner simply waits for a decode to show up with the same
room) and in plain mode. A refused *prefill* leg is not retried: its decode partner was sent at
the same time and may already be running with that prefill's address, and a request that may
be running is never replayed; the client gets a fast 503 and the prefill's breaker is charged.
Nothing that may have reached a worker (timeout, broken connection, an answer) is retried.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import msgspec
from aiohttp import web

from common.server.errors import ApiError
from router.logprobs import merge_bodies
from router.policies import RouteKey
from router.request_plan import RequestPlan, add_bootstrap, random_rooms, room_for_rank
from router.state import RouterState
from router.stream_relay import PrefillWatch, Relay
from router.upstream import Leg, LegFailure
from router.workers import Role, Worker


def _stream_headers(leg: Leg, request_id: str) -> dict[str, str]:
    """The worker's content type (text/event-stream from our workers), no caching, the id."""
    return {"Content-Type": leg.response.headers.get("content-type", "text/event-stream"),
            "Cache-Control": "no-cache", "X-Request-Id": request_id}


def _failure_of(task: asyncio.Task) -> LegFailure | None:
    if not task.done() or task.cancelled():
        return None
    exc = task.exception()
    if exc is None:
        return None
    if isinstance(exc, LegFailure):
        return exc
    raise exc


async def _cancel(*tasks: asyncio.Task) -> None:
    pending = [t for t in tasks if not t.done()]
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)


def _consume_result(task: asyncio.Task) -> None:
    """Done callback: a leg that failed after the answer was sent is not an unretrieved error."""
    if not task.cancelled():
        task.exception()


async def _open_with_retry(state: RouterState, role: Role, key: RouteKey, first: Worker,
                           payload_for: Callable[[Worker], bytes], path: str,
                           request_id: str) -> Leg:
    """An opened leg (headers in); a refused connection moves on to another worker."""
    worker, tried, attempt = first, [], 1
    while True:
        leg = state.leg(worker, path, payload_for(worker), request_id)
        try:
            await leg.open()
            return leg
        except LegFailure as failure:
            if failure.maybe_started or attempt >= state.args.max_attempts:
                raise
            tried.append(worker)
            await asyncio.sleep(state.backoff_s(attempt))
            try:
                worker = state.pick(role, key, exclude=tried)
            except ApiError:
                raise failure from None
            attempt += 1
            state.metrics.retries.labels(role.value).inc()


async def _fetch_with_retry(state: RouterState, role: Role, key: RouteKey, first: Worker,
                            payload_for: Callable[[Worker], bytes], path: str, request_id: str,
                            partner: Worker | None) -> tuple[int, str, bytes]:
    leg = await _open_with_retry(state, role, key, first, payload_for, path, request_id)
    try:
        if leg.response.status >= 400:
            raise await leg.status_failure(charge=partner is None or partner.available)
        body = await leg.read()
        leg.finish(True)
        return leg.response.status, leg.response.content_type, body
    finally:
        leg.finish(None)


def _answer(status: int, content_type: str, body: bytes, request_id: str) -> web.Response:
    return web.Response(body=body, status=status,
                        headers={"Content-Type": content_type, "X-Request-Id": request_id})


# ---- PD ------------------------------------------------------------------------------------
def _prefill_rooms(state: RouterState, prefill: Worker, count: int) -> list[int]:
    """Fresh rooms; with --dp-aware each one lands on the least-loaded prefill DP rank."""
    load = prefill.load
    if not (state.args.dp_aware and load is not None
            and load.is_fresh(state.args.load_stale_secs)):
        return random_rooms(count, state.rng)
    rooms = []
    for _ in range(count):
        rank = load.least_loaded_rank()
        if rank is None:
            rooms.append(state.rng.getrandbits(63))
            continue
        rank.extra_requests += 1
        load.extra_requests += 1
        rooms.append(room_for_rank(rank.dp_rank, load.num_dp_slots, state.rng))
    return rooms


def _decode_payload_for(state: RouterState, plan: RequestPlan,
                        shared: bytes) -> Callable[[Worker], bytes]:
    """The decode leg's body: the shared one, or with --dp-aware the decode's lightest rank."""
    if not state.args.dp_aware or "routed_dp_rank" in plan.body:
        return lambda worker: shared

    def payload_for(worker: Worker) -> bytes:
        load = worker.load
        if load is None or not load.is_fresh(state.args.load_stale_secs):
            return shared
        rank = load.least_loaded_rank()
        if rank is None:
            return shared
        rank.extra_requests += 1
        return msgspec.json.encode({**plan.body, "routed_dp_rank": rank.dp_rank})

    return payload_for


async def dispatch_pd(state: RouterState, request: web.Request, plan: RequestPlan, path: str,
                      request_id: str) -> web.StreamResponse:
    prefill = state.pick(Role.PREFILL, plan.key)
    decode = state.pick(Role.DECODE, plan.key)
    rooms = _prefill_rooms(state, prefill, plan.num_rooms)
    add_bootstrap(plan, prefill.host, prefill.bootstrap_port, rooms)
    shared = msgspec.json.encode(plan.body)
    decode_payload = _decode_payload_for(state, plan, shared)
    prefill_leg = state.leg(prefill, path, shared, request_id)
    # For troubleshooting: which prefill served it, and the rooms (prefill DP rank =
    # room % the prefill's DP slots); the decode side reports its rank in meta_info.dp_rank.
    trace = {"X-PD-Prefill": prefill.url, "X-PD-Bootstrap-Room": ",".join(map(str, rooms))}
    if plan.stream:
        return await _pd_stream(state, request, plan, path, request_id, prefill_leg, decode,
                                decode_payload, trace)
    response = await _pd_unary(state, plan, path, request_id, prefill_leg, decode,
                               decode_payload)
    response.headers.update(trace)
    return response


async def _pd_unary(state: RouterState, plan: RequestPlan, path: str, request_id: str,
                    prefill_leg: Leg, decode: Worker,
                    decode_payload: Callable[[Worker], bytes]) -> web.Response:
    """The prefill leg is driven by callbacks (`Leg.start`) and the decode leg runs right here,
    in the handler's task: no task or `asyncio.wait` per request (see docs/benchmarks.md,
    Router). A prefill failure while decode is pending cancels this task, which closes the
    decode connection (uncharged), and becomes the answer."""
    handler = asyncio.current_task()
    decode_pending = True
    prefill_failure: LegFailure | None = None
    prefill_body: asyncio.Future | None = None  # only to merge prompt logprobs

    def on_prefill_done(failure: LegFailure | None, body: bytes) -> None:
        nonlocal prefill_failure
        if prefill_body is not None and not prefill_body.done():
            prefill_body.set_result(None if failure is not None else body)
        if failure is not None and decode_pending:
            prefill_failure = failure
            handler.cancel()

    if plan.wants_input_logprobs:
        prefill_body = asyncio.get_running_loop().create_future()
    prefill_leg.start(on_prefill_done, lambda: decode.available)
    try:
        try:
            status, content_type, body = await _fetch_with_retry(
                state, Role.DECODE, plan.key, decode, decode_payload, path, request_id,
                prefill_leg.worker)
        except LegFailure as failure:
            decode_pending = False
            prefill_leg.finish(None)
            return failure.response(request_id)
        except asyncio.CancelledError:
            decode_pending = False
            if prefill_failure is None or handler.uncancel() > 0:
                raise
            return prefill_failure.response(request_id)
        decode_pending = False
        if prefill_body is not None:
            prompt = await prefill_body
            if prompt is not None:
                body = merge_bodies(body, prompt)
        # else the answer is complete; the prefill reply drains into its callback
        return _answer(status, content_type, body, request_id)
    except BaseException:
        decode_pending = False
        prefill_leg.finish(None)  # the client left: both workers abort on disconnect
        raise


async def _pd_stream(state: RouterState, request: web.Request, plan: RequestPlan, path: str,
                     request_id: str, prefill_leg: Leg, decode: Worker,
                     decode_payload: Callable[[Worker], bytes],
                     trace: dict[str, str]) -> web.StreamResponse:
    prefill = prefill_leg.worker
    watch = PrefillWatch(prefill_leg, decode, capture_logprobs=plan.wants_input_logprobs)
    p_task = asyncio.create_task(watch.run())
    p_task.add_done_callback(_consume_result)
    d_task = asyncio.create_task(_open_with_retry(
        state, Role.DECODE, plan.key, decode, decode_payload, path, request_id))
    try:
        await asyncio.wait((p_task, d_task), return_when=asyncio.FIRST_COMPLETED)
        if not d_task.done() and (failure := _failure_of(p_task)) is not None:
            await _cancel(d_task)
            return failure.response(request_id)
        try:
            decode_leg: Leg = await d_task
        except LegFailure as failure:
            await _cancel(p_task)
            return failure.response(request_id)
        if decode_leg.response.status != 200:
            failure = await decode_leg.status_failure(charge=prefill.available)
            await _cancel(p_task)
            return failure.response(request_id)
        response = web.StreamResponse(
            status=200, headers={**_stream_headers(decode_leg, request_id), **trace})
        await response.prepare(request)
        relay = Relay(decode_leg, response, watch if plan.wants_input_logprobs else None,
                      p_task, state.args.request_timeout_secs)

        def on_prefill_done(task: asyncio.Task) -> None:
            if not task.cancelled() and isinstance(task.exception(), LegFailure):
                relay.abort(task.exception())

        if (failure := _failure_of(p_task)) is not None:
            relay.abort(failure)
        else:
            p_task.add_done_callback(on_prefill_done)
        await relay.run()
        if not p_task.done():
            state.keep(p_task)
        return response
    except BaseException:
        await _cancel(p_task, d_task)
        if d_task.done() and not d_task.cancelled() and d_task.exception() is None:
            d_task.result().finish(None)  # opened, then the client left: settle it
        raise


# ---- plain mode -----------------------------------------------------------------------------
async def dispatch_plain(state: RouterState, request: web.Request, plan: RequestPlan, path: str,
                         request_id: str) -> web.StreamResponse:
    worker = state.pick(Role.REGULAR, plan.key)
    payload = msgspec.json.encode(plan.body)
    payload_for = lambda _worker: payload  # noqa: E731
    if not plan.stream:
        try:
            status, content_type, body = await _fetch_with_retry(
                state, Role.REGULAR, plan.key, worker, payload_for, path, request_id, None)
        except LegFailure as failure:
            return failure.response(request_id)
        return _answer(status, content_type, body, request_id)
    try:
        leg = await _open_with_retry(state, Role.REGULAR, plan.key, worker, payload_for, path,
                                     request_id)
    except LegFailure as failure:
        return failure.response(request_id)
    try:
        if leg.response.status != 200:
            return (await leg.status_failure()).response(request_id)
        response = web.StreamResponse(status=200, headers=_stream_headers(leg, request_id))
        await response.prepare(request)
        await Relay(leg, response).run()
        return response
    finally:
        leg.finish(None)
