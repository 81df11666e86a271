"""Channel child process -> launcher, once at start-up over a pipe: ready (with the values the
child resolved) or the error that stopped it."""

from __future__ import annotations

import msgspec


class SchedulerReady(msgspec.Struct, tag="scheduler_ready", kw_only=True, frozen=True):
    architecture: str
    device: str
    dtype: str
    vocab_size: int
    context_length: int
    max_total_tokens: int
    num_pages: int
    page_size: int
    max_running_requests: int
    chunked_prefill_size: int


class ProcessReady(msgspec.Struct, tag="ready", kw_only=True, frozen=True):
    name: str


class StartupFailed(msgspec.Struct, tag="failed", kw_only=True, frozen=True):
    name: str
    error: str


LaunchMessage = SchedulerReady | ProcessReady | StartupFailed

encoder = msgspec.msgpack.Encoder()
decoder = msgspec.msgpack.Decoder(LaunchMessage)
