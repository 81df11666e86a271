"""Server-sent events: `data: <json>\n\n` per chunk, `data: [DONE]` at the end."""

from __future__ import annotations

import msgspec
from aiohttp import web


async def open_stream(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(
        status=200,
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"},
    )
    await response.prepare(request)
    return response


async def send_event(response: web.StreamResponse, payload: object) -> None:
    await response.write(b"data: " + msgspec.json.encode(payload) + b"\n\n")


async def send_done(response: web.StreamResponse) -> None:
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
