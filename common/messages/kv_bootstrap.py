"""PD rendezvous messages: the prefill bootstrap server's registry, and the control channel
between a decode rank and the prefill rank that serves a room.

Bootstrap server (HTTP JSON, on the prefill service's --disaggregation-bootstrap-port):
    PUT /route         RankRegistration         a prefill DP rank announces itself
    GET /route         PrefillTopology          503 until every started rank registered
    GET /route?prefill_dp_rank=k  RankRegistration   404 unknown rank, 400 bad query

Control channel (ZMQ PUSH -> PULL over TCP, msgpack, tagged):
    decode -> prefill rank   KVRequest (the room's destination pages), KVAbort
    prefill -> decode rank   KVStatus (the room failed on prefill, or the abort is done)
"""

from __future__ import annotations

import msgspec


class RankRegistration(msgspec.Struct, kw_only=True, frozen=True):
    dp_rank: int
    control_endpoint: str  # host:port of the rank's ZMQ PULL for KVRequest / KVAbort
    num_layers: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    transfer_backend: str


class PrefillTopology(msgspec.Struct, kw_only=True, frozen=True):
    num_dp_slots: int  # the modulus: rank of a room = room % num_dp_slots
    transfer_backend: str
    ranks: dict[int, RankRegistration]


class KVRequest(msgspec.Struct, tag="kv_request", kw_only=True, frozen=True):
    room: int
    decode_rank: int
    notify_endpoint: str  # host:port of the decode rank's PULL for KVStatus
    kv_endpoint: str  # where the transfer backend delivers this room's pages
    dst_pages: list[int]
    prompt_len: int
    prefill_dp_rank: int  # the rank decode computed (room % slots), checked by prefill


class KVAbort(msgspec.Struct, tag="kv_abort", kw_only=True, frozen=True):
    room: int
    reason: str


class KVStatus(msgspec.Struct, tag="kv_status", kw_only=True, frozen=True):
    room: int
    failed: bool
    message: str = ""


ControlMessage = KVRequest | KVAbort | KVStatus

encoder = msgspec.msgpack.Encoder()
decoder = msgspec.msgpack.Decoder(ControlMessage)
