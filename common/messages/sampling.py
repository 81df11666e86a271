"""Types shared by several channels: sampling parameters, finish reasons, logprob entries."""

from __future__ import annotations

import msgspec


class SamplingParams(msgspec.Struct, kw_only=True, frozen=True):
    """Validated by the front end; the scheduler trusts these values."""

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no top-k
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    logit_bias: dict[int, float] = {}

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


class FinishReason(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    """SGLang's shape: {"type": "stop", "matched": 2} / {"type": "length", "length": 16} /
    {"type": "abort", "message": "..."}. `status` is the HTTP status an abort maps to."""

    type: str
    matched: int | str | None = None
    length: int | None = None
    message: str | None = None
    status: int | None = None
    param: str | None = None  # the request field an abort blames, if any


class TopLogprobs(msgspec.Struct, array_like=True, frozen=True):
    token_ids: list[int]
    logprobs: list[float]
