"""An in-process PD pair for tests: a prefill and a decode EngineCore on one tiny model, their
queues, a real transfer backend over loopback, and the control channel as in-memory lists.

    pair = PDPair(model_dir, backend="tcp")
    pair.submit("r1", prompt, greedy(8))      # the same request to both sides, one room
    pair.run()                                # step both until idle
    pair.decode_outputs["r1"], pair.prefill_finish["r1"]
"""

from __future__ import annotations

import random
from collections import defaultdict

from common.config import ServerArgs
from common.engine.engine import EngineCore
from common.engine.loader import load_engine_parts
from common.engine.tokenizer import Tokenizer
from common.messages.kv_bootstrap import KVAbort, KVRequest, KVStatus, PrefillTopology
from common.messages.kv_bootstrap import RankRegistration
from common.messages.scheduler_input import GenerateRequest
from common.transfer.registry import make_receiver, make_sender
from common.transfer.tcp import pool_layout
from decode.prefill_directory import PeerEntry, PeerState
from decode.queues import DecodeQueues, DecodeTimeouts
from prefill.queues import PrefillQueues, PrefillTimeouts

PREFILL_ENDPOINT = "prefill-rank-0"
DECODE_ENDPOINT = "decode-rank-0"


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class StaticDirectory:
    """The prefill directory with a fixed answer (state and topology set by the test)."""

    def __init__(self, topology: PrefillTopology):
        self.entry = PeerEntry("127.0.0.1", 8998, PeerState.READY, topology)

    def lookup(self, host: str, port: int) -> PeerEntry:
        return self.entry


def engine(model_dir, **kw) -> EngineCore:
    kw.setdefault("max_total_tokens", 1024)
    kw.setdefault("device", "cpu")
    args = ServerArgs(model_path=str(model_dir), **kw)
    return EngineCore(args, load_engine_parts(args, str(model_dir)),
                      Tokenizer.from_model_path(model_dir))


class PDPair:
    def __init__(self, model_dir, backend: str = "tcp", page_size: int = 4,
                 prefill_slots: int = 1, **engine_kw):
        self.clock = FakeClock()
        self.prefill = engine(model_dir, page_size=page_size, **engine_kw)
        self.decode = engine(model_dir, page_size=page_size, **engine_kw)
        self.to_prefill: list = []
        self.to_decode: list = []
        self.sender = make_sender(backend, self.prefill.pool, 30.0)
        self.receiver = make_receiver(backend, self.decode.pool, "127.0.0.1", 30.0)
        self.p = PrefillQueues(self.prefill, self.sender, self._prefill_sends, prefill_slots,
                               PrefillTimeouts(bootstrap=5, transferring=5), self.clock)
        layout = pool_layout(self.prefill.pool)
        reg = RankRegistration(dp_rank=0, control_endpoint=PREFILL_ENDPOINT,
                               num_layers=layout.num_layers, page_size=layout.page_size,
                               num_kv_heads=layout.num_kv_heads, head_dim=layout.head_dim,
                               dtype=layout.dtype, transfer_backend=backend)
        self.directory = StaticDirectory(PrefillTopology(
            num_dp_slots=prefill_slots, transfer_backend=backend, ranks={0: reg}))
        self.d = DecodeQueues(self.decode, self.receiver, self.directory, self._decode_sends,
                              DECODE_ENDPOINT,
                              DecodeTimeouts(bootstrap=5, waiting_for_input=5, transferring=5),
                              self.clock)
        self.prefill_outputs: dict[str, list[int]] = defaultdict(list)
        self.decode_outputs: dict[str, list[int]] = defaultdict(list)
        self.prefill_finish: dict[str, object] = {}
        self.decode_finish: dict[str, object] = {}
        self.decode_deltas: dict[str, list] = defaultdict(list)
        self.prefill_deltas: dict[str, list] = defaultdict(list)
        self.start_free = (self.prefill.pool.allocator.num_free_pages,
                           self.decode.pool.allocator.num_free_pages)

    # control channel: prefill only talks to our one decode endpoint and vice versa
    def _prefill_sends(self, endpoint: str, msg) -> bool:
        assert endpoint == DECODE_ENDPOINT and isinstance(msg, KVStatus)
        self.to_decode.append(msg)
        return True

    def _decode_sends(self, endpoint: str, msg) -> bool:
        assert endpoint == PREFILL_ENDPOINT and isinstance(msg, (KVRequest, KVAbort))
        self.to_prefill.append(msg)
        return True

    def request(self, rid: str, prompt: list[int], sampling, room: int | None = None,
                **kw) -> GenerateRequest:
        room = random.getrandbits(63) if room is None else room
        return GenerateRequest(rid=rid, input_ids=prompt, sampling=sampling, bootstrap_room=room,
                               bootstrap_host="127.0.0.1", bootstrap_port=8998, **kw)

    def submit(self, rid: str, prompt: list[int], sampling, room: int | None = None, **kw):
        msg = self.request(rid, prompt, sampling, room, **kw)
        self.collect_decode(self.d.add(msg))
        self.collect_prefill(self.p.add(msg))
        return msg

    def collect_prefill(self, deltas) -> None:
        for d in deltas:
            self.prefill_outputs[d.rid].extend(d.new_ids)
            self.prefill_deltas[d.rid].append(d)
            if d.finished:
                self.prefill_finish[d.rid] = d.finish_reason

    def collect_decode(self, deltas) -> None:
        for d in deltas:
            self.decode_outputs[d.rid].extend(d.new_ids)
            self.decode_deltas[d.rid].append(d)
            if d.finished:
                self.decode_finish[d.rid] = d.finish_reason

    def turn(self) -> None:
        """One loop turn of each side, the way the scheduler process runs it."""
        for msg in self.to_prefill[:]:
            self.to_prefill.remove(msg)
            if isinstance(msg, KVRequest):
                self.collect_prefill(self.p.on_kv_request(msg))
            else:
                self.collect_prefill(self.p.on_kv_abort(msg))
        for msg in self.to_decode[:]:
            self.to_decode.remove(msg)
            self.collect_decode(self.d.on_status(msg))
        self.collect_prefill(self.p.tick())
        self.collect_decode(self.d.tick())
        if self.prefill.has_work():
            self.collect_prefill(self.prefill.step())
        if self.decode.has_work():
            self.collect_decode(self.decode.step())

    def busy(self) -> bool:
        return (self.prefill.has_work() or self.decode.has_work() or self.p.waiting_on_io()
                or self.d.waiting_on_io() or bool(self.to_prefill or self.to_decode))

    def run(self, max_turns: int = 20_000) -> None:
        import time

        for _ in range(max_turns):
            if not self.busy():
                return
            self.turn()
            if not (self.prefill.has_work() or self.decode.has_work()):
                time.sleep(0.001)  # a transfer thread is moving bytes
        raise AssertionError("the PD pair never went idle")

    def pools_whole(self) -> bool:
        return (self.prefill.pool.allocator.num_free_pages,
                self.decode.pool.allocator.num_free_pages) == self.start_free

    def close(self) -> None:
        self.receiver.close()
