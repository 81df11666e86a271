"""Channel front end -> scheduler: tokenized requests and control messages.

With dp_size 1 the front end PUSHes each message as one msgpack frame straight to the scheduler.
With dp_size > 1 the DataParallelController sits on this channel, and requests carry their
routing information in a separate, tiny first frame, so the controller never decodes a request
body (see `controller_frames`, the one function that builds these messages):

    [RouteHeader, GenerateRequest]                 one request
    [list[RouteHeader], GenerateRequest x N]       one HTTP batch of N >= 2 requests (the
                                                   controller refreshes its budget once)
    [AbortRequest | FlushCacheRequest | StatsRequest | SetSlotState]    control: one frame

The controller tells them apart by the frame count (1: control, 2: one request, more: a
batch), decodes only the header frame, and forwards each request frame unchanged (zero-copy) to
the chosen scheduler as a plain single-frame message: schedulers always receive single frames.
`SetSlotState` is handled by the controller only; aborts go to the owning rank (or every rank),
flush and stats requests to every started rank.
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


SchedulerInput = GenerateRequest | AbortRequest | FlushCacheRequest | StatsRequest | SetSlotState

encoder = msgspec.msgpack.Encoder()
decoder = msgspec.msgpack.Decoder(SchedulerInput)


# ---- front end -> DP controller: routing header frames ----------------------------------------
# The controller routes on these few fields and forwards each request's bytes unchanged, so its
# per-request work does not depend on the request body (decoding 2,048 token ids, even only to
# skip them, costs tens of microseconds; this header costs well under one).


class RouteHeader(msgspec.Struct, array_like=True, frozen=True):
    """What the controller needs of one request: `Dispatcher.place`'s inputs and, for its
    DispatchReport, the rid. Encoded as a msgpack array: [rid, num_tokens, routed_dp_rank,
    bootstrap_room]."""

    rid: str
    num_tokens: int  # len(input_ids): total_tokens' speculative increment
    routed_dp_rank: int | None = None
    bootstrap_room: int | None = None


def route_of(req: GenerateRequest) -> RouteHeader:
    return RouteHeader(req.rid, len(req.input_ids), req.routed_dp_rank, req.bootstrap_room)


def controller_frames(reqs: list[GenerateRequest]) -> list[bytes]:
    """The multipart message that submits `reqs` (one HTTP request or batch) to the DP
    controller: [header, body] for one request, [headers, body, ..., body] for several (the
    controller refreshes its load budget once for them all). Control messages are not built
    here: they stay single frames, `encoder.encode(msg)`."""
    if not reqs:
        raise ValueError("no request to send")
    encode = encoder.encode
    if len(reqs) == 1:
        req = reqs[0]
        return [encode(route_of(req)), encode(req)]
    return [encode([route_of(r) for r in reqs]), *(encode(r) for r in reqs)]


ControlInput = AbortRequest | FlushCacheRequest | StatsRequest | SetSlotState
route_decoder = msgspec.msgpack.Decoder(RouteHeader)
batch_route_decoder = msgspec.msgpack.Decoder(list[RouteHeader])
control_decoder = msgspec.msgpack.Decoder(ControlInput)
