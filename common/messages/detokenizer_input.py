"""Channel scheduler -> detokenizer: new token ids per request, once per scheduler step."""

from __future__ import annotations

import msgspec

from common.messages.sampling import FinishReason, TopLogprobs


class TokenDelta(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    rid: str
    new_ids: list[int]
    prompt_tokens: int
    completion_tokens: int
    finished: bool = False
    finish_reason: FinishReason | None = None
    # Detokenizer settings, repeated on every delta so the detokenizer needs no other channel.
    skip_special_tokens: bool = True
    stop: list[str] = []
    no_stop_trim: bool = False
    output_logprobs: list[float] = []
    output_top_logprobs: list[TopLogprobs] = []
    # Prompt logprobs arrive once, on the delta that carries the first output token.
    input_logprobs: list[float | None] = []
    input_top_logprobs: list[TopLogprobs] = []
    input_logprob_start: int = 0
    dp_rank: int = 0


class TokenBatch(msgspec.Struct, tag="tokens", kw_only=True, frozen=True):
    deltas: list[TokenDelta]


class FlushCacheResult(msgspec.Struct, tag="flush_cache_result", kw_only=True, frozen=True):
    request_id: str
    dp_rank: int
    success: bool
    message: str = ""


class EngineStats(msgspec.Struct, tag="stats_result", kw_only=True, frozen=True):
    """Scheduler state for troubleshooting and for tests that check KV accounting."""

    request_id: str
    dp_rank: int
    num_running_reqs: int
    num_waiting_reqs: int
    num_free_pages: int
    num_total_pages: int
    page_size: int
    num_retractions: int
    num_steps: int


DetokenizerInput = TokenBatch | FlushCacheResult | EngineStats

encoder = msgspec.msgpack.Encoder()
decoder = msgspec.msgpack.Decoder(DetokenizerInput)
