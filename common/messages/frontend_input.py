"""Channel detokenizer -> front end: text deltas per request, and control replies."""

from __future__ import annotations

import msgspec

from common.messages.detokenizer_input import EngineStats, FlushCacheResult
from common.messages.sampling import FinishReason, TopLogprobs


class TextDelta(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    rid: str
    text: str
    new_ids: list[int]
    prompt_tokens: int
    completion_tokens: int
    finished: bool = False
    finish_reason: FinishReason | None = None
    output_logprobs: list[float] = []
    output_top_logprobs: list[TopLogprobs] = []
    input_logprobs: list[float | None] = []
    input_top_logprobs: list[TopLogprobs] = []
    input_logprob_start: int = 0
    dp_rank: int = 0


class TextBatch(msgspec.Struct, tag="text", kw_only=True, frozen=True):
    deltas: list[TextDelta]


class DispatchFailure(msgspec.Struct, kw_only=True, frozen=True):
    rid: str
    status: int
    message: str
    param: str | None = None


class DispatchReport(msgspec.Struct, tag="dispatched", kw_only=True, frozen=True):
    """Controller -> front end: where requests went (so a dead rank's requests can be failed),
    and the requests that could not be placed, each with its HTTP status."""

    rids: list[str] = []
    ranks: list[int] = []
    failed: list[DispatchFailure] = []


# Control replies pass through the detokenizer unchanged.
FrontendInput = TextBatch | FlushCacheResult | EngineStats | DispatchReport

encoder = msgspec.msgpack.Encoder()
decoder = msgspec.msgpack.Decoder(FrontendInput)
