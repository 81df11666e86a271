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


class TextBatch(msgspec.Struct, tag="text", kw_only=True, frozen=True):
    deltas: list[TextDelta]


# Control replies pass through the detokenizer unchanged.
FrontendInput = TextBatch | FlushCacheResult | EngineStats

encoder = msgspec.msgpack.Encoder()
decoder = msgspec.msgpack.Decoder(FrontendInput)
