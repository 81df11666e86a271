"""Channel front end -> scheduler: tokenized requests and control messages."""

from __future__ import annotations

import msgspec

from common.messages.sampling import SamplingParams


class GenerateRequest(msgspec.Struct, tag="generate", kw_only=True, frozen=True):
    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    stream: bool = False
    return_logprob: bool = False
    # First prompt position whose logprob is returned; -1: none of the prompt.
    logprob_start_len: int = -1
    top_logprobs_num: int = 0


class AbortRequest(msgspec.Struct, tag="abort", kw_only=True, frozen=True):
    rid: str
    message: str = "aborted"


class FlushCacheRequest(msgspec.Struct, tag="flush_cache", kw_only=True, frozen=True):
    request_id: str


class StatsRequest(msgspec.Struct, tag="stats", kw_only=True, frozen=True):
    request_id: str


SchedulerInput = GenerateRequest | AbortRequest | FlushCacheRequest | StatsRequest

encoder = msgspec.msgpack.Encoder()
decoder = msgspec.msgpack.Decoder(SchedulerInput)
