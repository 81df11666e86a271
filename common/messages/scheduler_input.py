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
    # PD decode: the prefill bootstrap server that serves `bootstrap_room`.
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None


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


# ---- the controller's view of this channel ----------------------------------------------------
# The controller routes on a few fields and forwards each request's bytes unchanged, so it never
# materialises prompts (decoding and re-encoding 2,048 token ids cost ~80 us per request).


class RoutedGenerate(msgspec.Struct, tag="generate", kw_only=True, frozen=True):
    rid: str
    input_ids: msgspec.Raw  # left encoded; only its length is read
    routed_dp_rank: int | None = None
    bootstrap_room: int | None = None


class RoutedBatch(msgspec.Struct, tag="generate_batch", kw_only=True, frozen=True):
    requests: list[msgspec.Raw]  # each one an encoded GenerateRequest


ControllerInput = (
    RoutedGenerate | RoutedBatch | AbortRequest | FlushCacheRequest | StatsRequest | SetSlotState
)
controller_decoder = msgspec.msgpack.Decoder(ControllerInput)
routed_generate_decoder = msgspec.msgpack.Decoder(RoutedGenerate)


def encoded_array_len(raw: msgspec.Raw) -> int:
    """Element count of an encoded msgpack array, read from its header."""
    data = memoryview(raw)
    head = data[0]
    if 0x90 <= head <= 0x9F:
        return head & 0x0F
    if head == 0xDC:
        return int.from_bytes(data[1:3], "big")
    if head == 0xDD:
        return int.from_bytes(data[1:5], "big")
    raise ValueError("not a msgpack array")
