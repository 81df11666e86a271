"""The DataParallelController process: a thin ZMQ loop around `Dispatcher`.

    PULL controller_input  GenerateRequest | GenerateBatch | AbortRequest | control | SetSlotState
      -> Dispatcher picks a rank           -> PUSH scheduler_input[rank] (the request's own
                                              bytes: only routing fields are decoded here)
      -> DispatchReport (ranks, failures)  -> PUSH frontend_input
    replies go scheduler -> detokenizer -> front end, never through here.
    PULL load relay (multi-node, load-aware methods only): other nodes' snapshots -> board

It blocks on the poller when there is nothing to read, and survives every per-request error:
a request that cannot be placed gets a DispatchFailure (HTTP 4xx/503 for that client only).
Aborts go to the rank that owns the request when the front end knows it, else to every rank;
flush and stats requests go to every started rank.
"""

from __future__ import annotations

import logging
import traceback
from multiprocessing.connection import Connection

import zmq

from common.config import ServerArgs
from common.dp.dispatch import LOAD_AWARE, DispatchError, DispatchItem, Dispatcher, SlotState
from common.loads.board import LoadBoard
from common.loads.relay import bind_relay, write_relayed
from common.messages import frontend_input, launch, scheduler_input
from common.messages.frontend_input import DispatchFailure, DispatchReport
from common.server.ipc import IpcPaths, drain_nowait
from common.server.topology import Topology
from common.server.process_utils import configure_logging, die_with_parent, report

logger = logging.getLogger(__name__)


class ControllerLoop:
    def __init__(
        self,
        dispatcher: Dispatcher,
        ipc: IpcPaths,
        topology: Topology | None = None,
        relay_board: LoadBoard | None = None,
        ctx: zmq.Context | None = None,
    ):
        self.dispatcher = dispatcher
        self.ctx = ctx or zmq.Context()
        self.recv = self.ctx.socket(zmq.PULL)
        self.recv.bind(ipc.controller_input)
        self.workers = []
        for rank in range(dispatcher.num_slots):
            sock = self.ctx.socket(zmq.PUSH)
            if topology is None or topology.on_node0(rank):
                sock.connect(ipc.scheduler_input_of(rank))
            else:
                sock.bind(topology.remote_scheduler_input(rank))  # the remote rank connects
            self.workers.append(sock)
        # With load-aware dispatch on several nodes, this process owns the load relay PULL.
        self.relay_board = relay_board
        self.relay = bind_relay(self.ctx, topology.load_relay) if relay_board else None
        self.poller = zmq.Poller()
        self.poller.register(self.recv, zmq.POLLIN)
        if self.relay is not None:
            self.poller.register(self.relay, zmq.POLLIN)
        self.to_frontend = self.ctx.socket(zmq.PUSH)
        self.to_frontend.connect(ipc.frontend_input)
        self.num_dispatched = 0
        # Dispatch outcomes collected while draining the socket, sent as one report.
        self._rids: list[str] = []
        self._ranks: list[int] = []
        self._failed: list[DispatchFailure] = []

    def run_forever(self) -> None:
        while True:
            if self.relay is None:
                # One input socket: a blocking recv wakes faster than a Poller wait.
                self.handle_raw(self.recv.recv())
            else:
                self.poller.poll()
                for raw in drain_nowait(self.relay):
                    write_relayed(self.relay_board, raw)
            # Everything already queued is handled before reporting, so reports batch up.
            for raw in drain_nowait(self.recv):
                self.handle_raw(raw)
            self.flush_report()

    # ---- message handling ----------------------------------------------------------------
    def handle_raw(self, raw: bytes) -> None:
        msg = scheduler_input.controller_decoder.decode(raw)
        if isinstance(msg, scheduler_input.RoutedGenerate):
            self._dispatch([(msg, raw)])
        elif isinstance(msg, scheduler_input.RoutedBatch):
            decode = scheduler_input.routed_generate_decoder.decode
            self._dispatch([(decode(item), bytes(item)) for item in msg.requests])
        else:
            self.handle_control(msg)

    def handle_control(self, msg) -> None:
        if isinstance(msg, scheduler_input.AbortRequest):
            ranks = [msg.dp_rank] if msg.dp_rank is not None else self._started_ranks()
            for rank in ranks:
                self.workers[rank].send(scheduler_input.encoder.encode(msg))
        elif isinstance(msg, (scheduler_input.FlushCacheRequest, scheduler_input.StatsRequest)):
            raw = scheduler_input.encoder.encode(msg)
            for rank in self._started_ranks():
                self.workers[rank].send(raw)
        elif isinstance(msg, scheduler_input.SetSlotState):
            self.dispatcher.set_state(msg.dp_rank, SlotState(msg.state))
            logger.info("DP rank %d is now %s", msg.dp_rank, msg.state)

    def _started_ranks(self) -> list[int]:
        return [r for r in range(self.dispatcher.num_slots) if self.dispatcher.is_available(r)]

    def _dispatch(self, reqs: list[tuple[scheduler_input.RoutedGenerate, bytes]]) -> None:
        """Place each request and forward its original bytes to the chosen rank."""
        items = [
            DispatchItem(scheduler_input.encoded_array_len(r.input_ids), r.routed_dp_rank,
                         r.bootstrap_room)
            for r, _ in reqs
        ]
        for (req, raw), rank in zip(reqs, self.dispatcher.place_batch(items)):
            if isinstance(rank, DispatchError):
                self._failed.append(DispatchFailure(
                    rid=req.rid, status=rank.status, message=rank.message, param=rank.param
                ))
                continue
            self.workers[rank].send(raw)
            self._rids.append(req.rid)
            self._ranks.append(rank)
            self.num_dispatched += 1

    def flush_report(self) -> None:
        if self._rids or self._failed:
            report_msg = DispatchReport(rids=self._rids, ranks=self._ranks, failed=self._failed)
            self.to_frontend.send(frontend_input.encoder.encode(report_msg))
            self._rids, self._ranks, self._failed = [], [], []


def run_controller_process(
    args: ServerArgs, method: str, ipc: IpcPaths, board_path: str | None, board_id: int,
    ready: Connection,
) -> None:
    die_with_parent()
    configure_logging(args.log_level, "dp-controller")
    try:
        board = LoadBoard.attach(board_path, args.num_dp_slots, board_id) if board_path else None
        dispatcher = Dispatcher(
            method, num_slots=args.num_dp_slots, num_active=args.dp_size,
            read_loads=board.read_all if board else None,
            refresh_interval=args.load_refresh_interval,
        )
        topology = Topology.from_args(args)
        owns_relay = topology.multi_node and method in LOAD_AWARE
        loop = ControllerLoop(dispatcher, ipc, topology, board if owns_relay else None)
    except Exception as exc:
        report(ready, launch.StartupFailed(name="dp-controller", error=f"{type(exc).__name__}: {exc}"))
        raise SystemExit(1) from None
    report(ready, launch.ProcessReady(name="dp-controller"))
    try:
        loop.run_forever()
    except Exception:
        logger.critical("DP controller crashed:\n%s", traceback.format_exc())
        raise SystemExit(1) from None
