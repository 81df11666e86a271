"""`GET /v1/loads`, `GET /metrics` and the DP rank administration routes.

/v1/loads answers from the shared-memory load board: every rank's latest snapshot (or one with
`?dp_rank=k`), its slot state and age, and an aggregate; `?format=prometheus` gives the same as
Prometheus text. A rank that has not published for STALE_AFTER seconds is flagged `stale`.
"""

from __future__ import annotations

import time

import msgspec
from aiohttp import web

from common.loads.snapshot import LoadSnapshot
from common.server.context import CTX, ServerContext
from common.server.errors import ApiError, decode_json

STALE_AFTER = 5.0
SUMMED = ("num_running_reqs", "num_waiting_reqs", "num_used_tokens", "num_total_tokens",
          "num_active_tokens", "max_total_num_tokens", "num_bootstrap_reqs",
          "num_inflight_reqs", "num_prealloc_reqs", "num_transfer_reqs", "num_retracted_reqs")


def _snapshot_json(snap: LoadSnapshot, state: str, now: float) -> dict:
    out = {f: getattr(snap, f) for f in snap.__struct_fields__}
    age = max(0.0, now - snap.timestamp)
    out.update(state=state, age_s=round(age, 3), stale=age > STALE_AFTER)
    return out


def _parse_rank(request: web.Request, num_slots: int) -> int | None:
    raw = request.query.get("dp_rank")
    if raw is None:
        return None
    try:
        rank = int(raw)
    except ValueError:
        raise ApiError(f"dp_rank must be an integer, got {raw!r}", "dp_rank") from None
    if not 0 <= rank < num_slots:
        raise ApiError(f"dp_rank {rank} is out of range [0, {num_slots})", "dp_rank", 404)
    return rank


async def handle_loads(request: web.Request) -> web.Response:
    ctx: ServerContext = request.app[CTX]
    dp = ctx.dp
    rank = _parse_rank(request, dp.num_slots)
    fmt = request.query.get("format", "json")
    if fmt not in ("json", "prometheus"):
        raise ApiError("format must be json or prometheus", "format")
    now = time.time()
    snaps = dp.loads()
    ranks = [rank] if rank is not None else range(dp.num_slots)
    entries = [
        _snapshot_json(snaps[r], dp.states[r].value, now) if snaps[r] is not None
        else {"dp_rank": r, "state": dp.states[r].value, "stale": True}
        for r in ranks
    ]
    published = [e for e in entries if "timestamp" in e]
    aggregate = {f: sum(e[f] for e in published) for f in SUMMED}
    used, capacity = aggregate["num_used_tokens"], aggregate["max_total_num_tokens"]
    aggregate["token_usage"] = used / capacity if capacity else 0.0
    if fmt == "prometheus":
        return web.Response(text=_prometheus(published), content_type="text/plain")
    return web.json_response({
        "timestamp": now,
        "dp_size": len(dp.available),
        "num_dp_slots": dp.num_slots,
        "load_balance_method": dp.method,
        "loads": entries,
        "aggregate": aggregate,
    })


def _prometheus(entries: list[dict]) -> str:
    lines = []
    for field in (*SUMMED, "token_usage", "age_s"):
        name = f"pdserve_load_{field}"
        lines.append(f"# TYPE {name} gauge")
        for e in entries:
            lines.append(f'{name}{{dp_rank="{e["dp_rank"]}",state="{e["state"]}"}} {e[field]}')
    return "\n".join(lines) + "\n"


async def handle_metrics(request: web.Request) -> web.Response:
    ctx: ServerContext = request.app[CTX]
    return web.Response(body=ctx.metrics.exposition(),
                        headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


class RankChange(msgspec.Struct, kw_only=True):
    active: bool


async def handle_list_ranks(request: web.Request) -> web.Response:
    ctx: ServerContext = request.app[CTX]
    return web.json_response({
        "load_balance_method": ctx.dp.method,
        "ranks": [{"dp_rank": r, "state": s.value} for r, s in enumerate(ctx.dp.states)],
    })


async def handle_change_rank(request: web.Request) -> web.Response:
    ctx: ServerContext = request.app[CTX]
    try:
        rank = int(request.match_info["rank"])
    except ValueError:
        raise ApiError("dp_rank must be an integer", "dp_rank") from None
    change = decode_json(await request.read(), RankChange)
    if change.active:
        await ctx.dp.activate(rank)
    else:
        await ctx.dp.deactivate(rank)
    return await handle_list_ranks(request)
