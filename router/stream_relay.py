"""Streaming: forward a worker's SSE bytes to the client, and watch the prefill side's stream.

`Relay` lifecycle:  relaying --EOF--> done (write_eof)
                    relaying --decode broke--> error event + `data: [DONE]` (decode charged)
                    relaying --abort(prefill failure)--> decode closed (not charged), the
                                                         prefill's error event + `data: [DONE]`
Bytes are written to the client as soon as `readany()` returns them: nothing waits for the
prefill reply. Only when prompt logprobs must be merged does the relay cut the stream into
events (to rewrite the JSON of each); a final chunk whose prompt logprobs have not arrived yet
waits for the prefill stream to end, so the merged logprobs are never lost.

`PrefillWatch` reads the prefill leg's stream to its end without keeping it: it notices a
failure (status >= 400, an error event, a broken connection) and keeps each item's prompt
logprobs when asked to.

Error events have the JSON shape of `common/server/errors.py`, then `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import msgspec
from aiohttp import web

from router.http_client import UpstreamResponse
from router.logprobs import merge_item, prompt_logprobs
from router.upstream import Leg, LegFailure
from router.workers import Worker

DONE_EVENT = b"data: [DONE]\n\n"


class PartnerFailed(Exception):
    """Raised inside the relay's read when the other leg (prefill) has failed."""


async def sse_events(content: UpstreamResponse) -> AsyncIterator[bytes]:
    """Complete events (ending in a blank line) as they arrive; a trailing partial one last."""
    buffer = bytearray()
    while True:
        data = await content.readany()
        if not data:
            if buffer.strip():
                yield bytes(buffer)
            return
        buffer += data
        while (cut := buffer.find(b"\n\n")) >= 0:
            event = bytes(buffer[:cut + 2])
            del buffer[:cut + 2]
            yield event


def event_json(event: bytes):
    """The JSON payload of a single-line `data: {...}` event, else None."""
    if not event.startswith(b"data: {"):
        return None
    try:
        return msgspec.json.decode(event[6:].strip())
    except msgspec.DecodeError:
        return None


def _is_final(chunk: dict) -> bool:
    meta = chunk.get("meta_info")
    return isinstance(meta, dict) and meta.get("finish_reason") is not None


class PrefillWatch:
    def __init__(self, leg: Leg, partner: Worker, capture_logprobs: bool):
        self.leg = leg
        self.partner = partner
        self.capture_logprobs = capture_logprobs
        self.captured: dict[int, dict] = {}

    async def run(self) -> None:
        leg = self.leg
        try:
            response = await leg.open()
            if response.status != 200:
                raise await leg.status_failure(charge=self.partner.available)
            events = sse_events(response)
            while True:
                try:
                    event = await anext(events)
                except StopAsyncIteration:
                    break
                except BaseException as exc:
                    raise leg.failure_from(exc) from None
                if not self.capture_logprobs and b'"error"' not in event:
                    continue  # nothing to look at: skip the JSON decoding
                chunk = event_json(event)
                if not isinstance(chunk, dict):
                    continue
                if "error" in chunk:
                    raise self._error_event(chunk["error"])
                if self.capture_logprobs:
                    index = chunk.get("index", 0)
                    if index not in self.captured and (part := prompt_logprobs(chunk)):
                        self.captured[index] = part
            leg.finish(True)
        finally:
            leg.finish(None)  # cancelled: no verdict (a no-op once settled)

    def _error_event(self, error) -> LegFailure:
        leg = self.leg
        error = error if isinstance(error, dict) else {"message": str(error)}
        code = error.get("code")
        status = code if isinstance(code, int) and 400 <= code < 600 else 502
        failure = LegFailure(leg.worker, "stream",
                             f"prefill worker {leg.worker.url} failed: "
                             f"{error.get('message', 'error event')}", status)
        if self.partner.available:
            return leg.fail(failure)
        leg.finish(None)
        return failure


class Relay:
    def __init__(self, leg: Leg, response: web.StreamResponse,
                 watch: PrefillWatch | None = None, prefill_task: asyncio.Task | None = None,
                 wait_for_prefill_s: float = 60.0):
        self.leg = leg
        self.response = response
        self.watch = watch  # set when prompt logprobs are merged
        self.prefill_task = prefill_task
        self.wait_for_prefill_s = wait_for_prefill_s
        self.at_event_boundary = True
        self.ended = False
        self.aborted_by: LegFailure | None = None

    def abort(self, failure: LegFailure) -> None:
        """The partner leg failed: stop relaying at the next read and end with its error."""
        if self.aborted_by is None and not self.ended:
            self.aborted_by = failure
            if self.leg.response is not None:
                self.leg.response.fail(PartnerFailed())

    async def write(self, data: bytes) -> None:
        await self.response.write(data)
        self.at_event_boundary = data.endswith(b"\n\n")

    async def run(self) -> None:
        leg = self.leg
        content = leg.response
        try:
            if self.watch is None:
                last = await self._run_raw(content)
            else:
                await self._run_merging(content)
                last = b""
            leg.finish(True)
        except LegFailure as failure:
            await self.end_with_error(failure.error_event())
            return
        except PartnerFailed:
            leg.finish(None)  # decode did nothing wrong; closing it makes the worker abort
            await self.end_with_error(self.aborted_by.error_event())
            return
        finally:
            leg.finish(None)  # cancelled or the client left: no verdict (no-op once settled)
        self.ended = True
        await self.response.write_eof(last)

    async def _run_raw(self, content: UpstreamResponse) -> bytes:
        """Forwards bytes as they arrive; returns the last piece unsent, so that it leaves
        with the end of the stream in one packet."""
        while True:
            try:
                data = await content.readany()
            except PartnerFailed:
                raise
            except BaseException as exc:
                raise self.leg.failure_from(exc) from None
            if not data:
                return b""
            if content.complete:
                return data
            await self.write(data)

    async def _run_merging(self, content: UpstreamResponse) -> None:
        events = sse_events(content)
        while True:
            try:
                event = await anext(events)
            except StopAsyncIteration:
                return
            except PartnerFailed:
                raise
            except BaseException as exc:
                raise self.leg.failure_from(exc) from None
            chunk = event_json(event)
            if isinstance(chunk, dict) and "error" not in chunk:
                index = chunk.get("index", 0)
                if index not in self.watch.captured and _is_final(chunk):
                    await self._wait_for_prefill()
                if index in self.watch.captured:
                    merge_item(chunk, self.watch.captured[index])
                    event = b"data: " + msgspec.json.encode(chunk) + b"\n\n"
            await self.write(event)

    async def _wait_for_prefill(self) -> None:
        if self.prefill_task is None or self.prefill_task.done():
            return
        await asyncio.wait((self.prefill_task,), timeout=self.wait_for_prefill_s)

    async def end_with_error(self, error: dict) -> None:
        """Ends the stream well-formed: close any partial event, an error event, [DONE]."""
        if self.ended:
            return
        self.ended = True
        try:
            if not self.at_event_boundary:
                await self.response.write(b"\n\n")
            await self.response.write(b"data: " + msgspec.json.encode(error) + b"\n\n")
            await self.response.write(DONE_EVENT)
            await self.response.write_eof()
        except (ConnectionError, RuntimeError):
            pass  # the client has gone: nobody left to tell
