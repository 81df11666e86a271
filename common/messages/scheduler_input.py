"""Channel front end -> scheduler: tokenized requests and control messages.

With dp_size > 1 the DataParallelController sits on this channel: it receives these messages
(plus `GenerateBatch` and `SetSlotState`, which only it handles), picks a rank per request, and
forwards the per-request messages unchanged to that rank's scheduler.
"""

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
    # Dispatch hints (SPEC section 2): an explicit rank, or the PD rendezvous room.
    routed_dp_rank: int | None = None
    bootstrap_room: int | None = None


class GenerateBatch(msgspec.Struct, tag="generate_batch", kw_only=True, frozen=True):
    """The items of one HTTP batch: the controller refreshes its load budget once for all."""

    requests: list[GenerateRequest]


class AbortRequest(msgspec.Struct, tag="abort", kw_only=True, frozen=True):
    rid: str
    message: str = "aborted"
    # The rank serving the request when the front end knows it; None: every rank.
    dp_rank: int | None = None


class FlushCacheRequest(msgspec.Struct, tag="flush_cache", kw_only=True, frozen=True):
    request_id: str


class StatsRequest(msgspec.Struct, tag="stats", kw_only=True, frozen=True):
    request_id: str


class SetSlotState(msgspec.Struct, tag="set_slot_state", kw_only=True, frozen=True):
    """Launcher -> controller: a rank was added, removed, or found dead."""

    dp_rank: int
    state: str  # "active" | "reserved" | "unavailable"


SchedulerInput = (
    GenerateRequest | GenerateBatch | AbortRequest | FlushCacheRequest | StatsRequest
    | SetSlotState
)

encoder = msgspec.msgpack.Encoder()
decoder = msgspec.msgpack.Decoder(SchedulerInput)
