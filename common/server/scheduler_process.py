"""The scheduler process of one DP rank: a ZMQ loop around `EngineCore`.

    PULL scheduler_input_of(rank)  GenerateRequest | AbortRequest | FlushCacheRequest | Stats
      -> engine.add / abort / flush_cache / stats
      -> engine.step() while there is work
    PUSH detokenizer_input         TokenBatch | FlushCacheResult | EngineStats
    load board slot `rank`         LoadSnapshot: after every prefill (extend) batch, every
                                   --load-publish-steps steps, on becoming idle, and once a
                                   second while idle (a heartbeat: the timestamp stays fresh)

PD roles (`prefill/worker.py`, `decode/worker.py`) add their control socket to the poller and
their queues in front of the engine: requests go through the queues, each loop turn ticks
them (timeouts, transfer states), and while they wait on a peer the poller wakes every
PD_POLL_MS instead of sleeping a second.

When idle it blocks on the poller (no busy loop). An exception inside the engine ends the
process: the launcher notices the death and reacts (the service stops, or with dp_size > 1 the
rank is marked unavailable and its requests fail).
"""

from __future__ import annotations

import gc
import logging
import secrets
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection

import msgspec
import torch
import zmq

from common.config import ServerArgs
from common.engine.engine import EngineCore
from common.engine.loader import load_engine_parts
from common.engine.tokenizer import Tokenizer
from common.loads.board import LoadBoard
from common.loads.relay import RelayPublisher
from common.loads.snapshot import LoadSnapshot
from common.messages import detokenizer_input, launch, scheduler_input
from common.server.ipc import IpcPaths, drain_nowait
from common.server.topology import Topology
from common.server.process_utils import configure_logging, die_with_parent, report

logger = logging.getLogger(__name__)

IDLE_HEARTBEAT_MS = 1000
PD_POLL_MS = 1


class SchedulerLoop:
    def __init__(
        self,
        engine: EngineCore,
        ctx: zmq.Context,
        recv: zmq.Socket,
        send: zmq.Socket,
        publish: Callable[[LoadSnapshot], None] | None,
        publish_steps: int,
        role=None,
    ):
        self.engine = engine
        self.role = role
        # Where requests go: the PD queues in front of the engine, or the engine itself.
        self.front = role.queues if role is not None else engine
        self._publish = publish
        self.publish_steps = publish_steps
        self.incarnation = secrets.randbits(62) | 1  # this process, in every snapshot
        self.ctx, self.recv, self.send = ctx, recv, send
        self.poller = zmq.Poller()
        self.poller.register(self.recv, zmq.POLLIN)
        if role is not None:
            self.poller.register(role.socket, zmq.POLLIN)
        self._steps_since_publish = 0
        self._published_idle = False
        self._last_counts: tuple = ()
        self._last_publish = 0.0

    def run_forever(self) -> None:
        self.publish()
        while True:
            busy = self.engine.has_work()
            if not busy and not self._published_idle:
                self.publish()
                self._published_idle = True
            waiting = self.role is not None and self.front.waiting_on_io()
            timeout = 0 if busy else PD_POLL_MS if waiting else IDLE_HEARTBEAT_MS
            events = dict(self.poller.poll(timeout))
            if self.recv in events:
                for raw in drain_nowait(self.recv):
                    self.handle(scheduler_input.decoder.decode(raw))
            if self.role is not None:
                if self.role.socket in events:
                    self._emit(self.role.on_control())
                self._emit(self.front.tick())
                if waiting and self._pd_changed():
                    self.publish()
            if not self.engine.has_work():
                if events:
                    self._published_idle = False  # queues changed: publish the idle state
                elif not waiting or time.monotonic() - self._last_publish > 1.0:
                    self.publish()  # heartbeat: the timestamp stays fresh while idle
                continue
            self._published_idle = False
            self._emit(self.engine.step())
            self._steps_since_publish += 1
            if self.engine.last_step_was_extend or self._steps_since_publish >= self.publish_steps:
                self.publish()

    def publish(self) -> None:
        self._steps_since_publish = 0
        self._last_publish = time.monotonic()
        if self._publish is not None:
            snap = self.front.load_snapshot()
            self._publish(msgspec.structs.replace(snap, incarnation=self.incarnation))

    def _pd_changed(self) -> bool:
        """While only PD queues move (no forward pass), publish when their counts change."""
        counts = self.front.queue_counts()
        changed = counts != self._last_counts
        self._last_counts = counts
        return changed

    def handle(self, msg) -> None:
        if isinstance(msg, scheduler_input.GenerateRequest):
            self._emit(self.front.add(msg))
        elif isinstance(msg, scheduler_input.AbortRequest):
            self._emit(self.front.abort(msg.rid, msg.message))
        elif isinstance(msg, scheduler_input.FlushCacheRequest):
            ok, text = self.engine.flush_cache()
            result = detokenizer_input.FlushCacheResult(
                request_id=msg.request_id, dp_rank=self.engine.dp_rank, success=ok, message=text
            )
            self.send.send(detokenizer_input.encoder.encode(result))
        elif isinstance(msg, scheduler_input.StatsRequest):
            self.send.send(detokenizer_input.encoder.encode(self.engine.stats(msg.request_id)))

    def _emit(self, deltas: list) -> None:
        if deltas:
            batch = detokenizer_input.TokenBatch(deltas=deltas)
            self.send.send(detokenizer_input.encoder.encode(batch))


def _endpoints(args: ServerArgs, ipc: IpcPaths | None, dp_rank: int, board_path: str | None,
               board_id: int):
    """Sockets and snapshot publisher of one rank: IPC and the board on node 0, TCP to node 0
    and the load relay on other nodes (see `topology.py`)."""
    topo = Topology.from_args(args)
    ctx = zmq.Context()
    recv, send = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    if topo.on_node0(dp_rank):
        recv.bind(ipc.scheduler_input_of(dp_rank))
        send.connect(ipc.detokenizer_input)
        board = LoadBoard.attach(board_path, args.num_dp_slots, board_id) if board_path else None
        publish = board.write if board is not None else None
    else:
        recv.connect(topo.remote_scheduler_input(dp_rank))
        send.connect(topo.detokenizer_tcp)
        publish = RelayPublisher(ctx, topo.load_relay).publish
    return ctx, recv, send, publish


def _pd_role(args: ServerArgs, engine: EngineCore, ctx: zmq.Context):
    if args.disaggregation_mode == "prefill":
        from prefill.worker import PrefillRole

        return PrefillRole(args, engine, ctx)
    if args.disaggregation_mode == "decode":
        from decode.worker import DecodeRole

        return DecodeRole(args, engine, ctx)
    return None


def run_scheduler_process(
    args: ServerArgs,
    model_path: str,
    ipc: IpcPaths | None,
    dp_rank: int,
    board_path: str | None,
    board_id: int,
    ready: Connection,
) -> None:
    die_with_parent()
    configure_logging(args.log_level, f"scheduler-{dp_rank}")
    try:
        if args.torch_num_threads:
            torch.set_num_threads(args.torch_num_threads)
        loaded = load_engine_parts(args, model_path)
        engine = EngineCore(args, loaded, Tokenizer.from_model_path(model_path), dp_rank)
        ctx, recv, send, publish = _endpoints(args, ipc, dp_rank, board_path, board_id)
        loop = SchedulerLoop(engine, ctx, recv, send, publish, args.load_publish_steps,
                             _pd_role(args, engine, ctx))
    except Exception as exc:  # start-up errors go back to the launcher, which prints them
        logger.debug("start-up failed:\n%s", traceback.format_exc())
        report(ready, launch.StartupFailed(name=f"scheduler-{dp_rank}",
                                           error=f"{type(exc).__name__}: {exc}"))
        raise SystemExit(1) from None
    report(
        ready,
        launch.SchedulerReady(
            architecture=loaded.config.architecture,
            device=str(loaded.device),
            dtype=str(loaded.dtype).removeprefix("torch."),
            vocab_size=loaded.config.vocab_size,
            context_length=loaded.context_length,
            max_total_tokens=loaded.pool.capacity_tokens,
            num_pages=loaded.pool.allocator.num_total_pages,
            page_size=args.page_size,
            max_running_requests=args.max_running_requests,
            chunked_prefill_size=args.chunked_prefill_size,
        ),
    )
    # Everything allocated so far (torch, the model, the pools) lives as long as the process:
    # moving it out of the collector's reach keeps full collections from scanning it, which
    # otherwise cost ~100 ms each (they stalled KV transfers that build many buffer views).
    gc.collect()
    gc.freeze()
    try:
        loop.run_forever()
    except Exception:
        logger.critical("scheduler %d crashed:\n%s", dp_rank, traceback.format_exc())
        raise SystemExit(1) from None
