"""`LoadSnapshot`: what one DP rank reports about its queues and KV usage (SPEC section 3).

Field meanings:
    num_running_reqs   requests in the running batch
    num_waiting_reqs   waiting queue (+ prefill bootstrap queue; + decode prealloc, transfer and
                       retracted queues)
    num_used_tokens    KV tokens held now
    num_total_tokens   used KV tokens + tokens still to be allocated or computed
    num_active_tokens  num_total_tokens minus tokens whose KV is still in flight from prefill
    max_total_num_tokens, token_usage   capacity and used / capacity
    per-queue counts   prefill bootstrap/inflight, decode prealloc/transfer/retracted
    incarnation        a random id of the scheduler process that published it (0: unknown):
                       when it changes, the rank restarted and lost what it was running
"""

from __future__ import annotations

import msgspec


class LoadSnapshot(msgspec.Struct, kw_only=True, frozen=True, array_like=True):
    dp_rank: int
    timestamp: float
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    num_used_tokens: int = 0
    num_total_tokens: int = 0
    num_active_tokens: int = 0
    max_total_num_tokens: int = 0
    token_usage: float = 0.0
    num_bootstrap_reqs: int = 0
    num_inflight_reqs: int = 0
    num_prealloc_reqs: int = 0
    num_transfer_reqs: int = 0
    num_retracted_reqs: int = 0
    incarnation: int = 0

    @property
    def num_requests(self) -> int:
        return self.num_running_reqs + self.num_waiting_reqs


encoder = msgspec.msgpack.Encoder()
decoder = msgspec.msgpack.Decoder(LoadSnapshot)
