"""A request inside the engine, from admission to its last token.

States: WAITING (in the scheduler's waiting queue; may hold pages if it is partly prefilled or
was retracted mid-chunk) -> RUNNING (prefill complete; one token per decode step) -> FINISHED.
A RUNNING request whose pages run short is *retracted*: its pages are freed, `num_computed`
drops to 0, and it waits at the head of the queue to be prefilled again over prompt + outputs.

`fill_ids` (prompt + outputs) is the sequence whose KV must exist; `num_computed` counts the
leading tokens of it whose KV is already in the pool. A running request always has exactly one
token (its last output) not yet in the pool: that is the token its next decode step feeds.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from common.messages.sampling import FinishReason, SamplingParams, TopLogprobs


class ReqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Req:
    rid: str
    prompt_ids: list[int]
    sampling: SamplingParams
    stream: bool = False
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    arrival_time: float = field(default_factory=time.monotonic)

    status: ReqStatus = ReqStatus.WAITING
    output_ids: list[int] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    num_computed: int = 0
    finish_reason: FinishReason | None = None
    generator: torch.Generator | None = None
    # Outputs already handed to the detokenizer channel.
    num_sent: int = 0
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[TopLogprobs] = field(default_factory=list)
    input_logprobs: list[float | None] = field(default_factory=list)
    input_top_logprobs: list[TopLogprobs] = field(default_factory=list)
    input_logprobs_done: bool = False

    @property
    def fill_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids if self.output_ids else self.prompt_ids

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def wants_input_logprobs(self) -> bool:
        return (
            self.return_logprob and self.logprob_start_len >= 0 and not self.input_logprobs_done
        )

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
