"""The DataParallelController process: a thin ZMQ loop around `Dispatcher`.

    PULL controller_input  [RouteHeader, request]            one request
                           [list[RouteHeader], request x N]  one HTTP batch (one budget refresh)
                           [AbortRequest | FlushCacheRequest | StatsRequest | SetSlotState]
      -> Dispatcher picks a rank from the header frame  -> PUSH scheduler_input[rank]: the
                                                           request frame, unchanged (zero-copy)
      -> DispatchReport (rids, ranks, failures)         -> PUSH frontend_input
    replies go scheduler -> detokenizer -> front end, never through here.
    PULL load relay (multi-node, load-aware methods only): other nodes' snapshots -> board

The front end builds these messages with `scheduler_input.controller_frames`. The frame count
says what a message is (1: control, 2: one request, more: a batch); only the small header frame
is decoded (rid, num_tokens, routed_dp_rank, bootstrap_room), and the request frame is passed on
as the zmq message it arrived in, so a dispatch costs the same whatever the prompt's length.
Schedulers receive plain single-frame GenerateRequests, exactly as with dp_size 1.

It blocks when there is nothing to read (on `recv()` of its one input socket, or on a poller
when it also owns the load relay), and survives every per-request error: a request that cannot
be placed gets a DispatchFailure (HTTP 4xx/503 for that client only); a malformed message is
logged and dropped (its requests, when their rids can be read, are failed).

Reports are off the forwarding path: a request's hop is just header decode -> Dispatcher -> send.
Outcomes are collected and sent as one DispatchReport once the oldest is REPORT_DELAY_MS old
(checked after each message; a quiet input times the wait out after as long again, so a report
is at most twice that late), or when REPORT_MAX_ITEMS are waiting; under load one report covers
many requests. Failures are reported at once (nothing was forwarded, and the client is waiting
for its error). Only dead-rank handling and abort routing in the front end read the ranks, and
both cope with a late report (an abort without a known rank goes to every rank; a report naming
a rank that died meanwhile fails the request then).

Aborts go to the rank that owns the request when the front end knows it, else to every rank;
flush and stats requests go to every started rank.
"""

from __future__ import annotations

import logging
import time
import traceback
from multiprocessing.connection import Connection

import msgspec
import zmq

from common.config import ServerArgs
from common.dp.dispatch import LOAD_AWARE, DispatchError, Dispatcher, SlotState
from common.loads.board import LoadBoard
from common.loads.relay import bind_relay, write_relayed
from common.messages import frontend_input, launch, scheduler_input
from common.messages.frontend_input import DispatchFailure, DispatchReport
from common.messages.scheduler_input import RouteHeader
from common.server.ipc import IpcPaths, drain_nowait
from common.server.topology import Topology
from common.server.process_utils import configure_logging, die_with_parent, report

logger = logging.getLogger(__name__)

# When dispatch outcomes go to the front end (see the module docstring).
REPORT_DELAY_MS = 10
REPORT_MAX_ITEMS = 512

_route = scheduler_input.route_decoder.decode
_routes = scheduler_input.batch_route_decoder.decode
_control = scheduler_input.control_decoder.decode


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
        # Dispatch outcomes not yet reported to the front end, and when they must go at the latest.
        self._rids: list[str] = []
        self._ranks: list[int] = []
        self._failed: list[DispatchFailure] = []
        self._report_due: float | None = None

    def run_forever(self) -> None:
        if self.relay is None:
            self._run_single_input()
        else:
            self._run_polled()

    def _run_single_input(self) -> None:
        """One input socket: a blocking recv wakes faster than a Poller wait. While outcomes
        wait to be reported it has a timeout (RCVTIMEO), so a quiet input still reports them.
        The hot path (one request: two frames) is inlined: every step here is on its hop."""
        recv = self.recv.recv
        place = self.dispatcher.place
        workers = self.workers
        monotonic = time.monotonic
        while True:
            try:
                # Frames, not bytes: nothing copied, and `.more` is read at no extra cost.
                head = recv(copy=False)
            except zmq.Again:  # quiet for REPORT_DELAY_MS
                self.flush_report()
                continue
            try:
                if not head.more:
                    self.handle_control(head.bytes)
                else:
                    body = recv(copy=False)  # the request, passed on as this zmq message
                    if body.more:
                        self._dispatch_batch(head, [body, *self._recv_rest(body)])
                    else:
                        route = _route(head)
                        try:
                            rank = place(route.num_tokens, route.routed_dp_rank,
                                         route.bootstrap_room)
                        except DispatchError as exc:
                            self._fail(route.rid, exc)
                        else:
                            workers[rank].send(body, copy=False)
                            self._dispatched(route.rid, rank)
            except msgspec.DecodeError as exc:
                self._malformed(exc)
            due = self._report_due
            if due is not None and (
                self._failed or monotonic() >= due or len(self._rids) >= REPORT_MAX_ITEMS
            ):
                self.flush_report()

    def _run_polled(self) -> None:
        """With the multi-node load relay: a Poller over both sockets, NOBLOCK drains."""
        recv = self.recv.recv
        while True:
            if not self.poller.poll(REPORT_DELAY_MS if self._report_due is not None else None):
                self.flush_report()  # quiet: time to report
                continue
            for raw in drain_nowait(self.relay):
                write_relayed(self.relay_board, raw)
            while True:
                try:
                    head = recv(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                self.handle_frames([head, *self._recv_rest(head)])
            due = self._report_due
            if due is not None and (
                self._failed or time.monotonic() >= due or len(self._rids) >= REPORT_MAX_ITEMS
            ):
                self.flush_report()

    def _recv_rest(self, last: zmq.Frame) -> list[zmq.Frame]:
        """The frames after `last` of the message being received (all already here: a
        multipart message arrives whole)."""
        frames = []
        while last.more:
            last = self.recv.recv(copy=False)
            frames.append(last)
        return frames

    # ---- message handling ----------------------------------------------------------------
    def handle_frames(self, frames: list) -> None:
        """One message from the front end, all its frames (the polled loop; the single-input
        loop inlines the one-request case)."""
        try:
            if len(frames) == 1:
                self.handle_control(frames[0].bytes)
            elif len(frames) == 2:
                self._dispatch_one(frames[0], frames[1])
            else:
                self._dispatch_batch(frames[0], frames[1:])
        except msgspec.DecodeError as exc:
            self._malformed(exc)

    def _dispatch_one(self, head, body) -> None:
        route = _route(head)
        try:
            rank = self.dispatcher.place(route.num_tokens, route.routed_dp_rank,
                                         route.bootstrap_room)
        except DispatchError as exc:
            self._fail(route.rid, exc)
            return
        self.workers[rank].send(body, copy=False)
        self._dispatched(route.rid, rank)

    def handle_control(self, raw: bytes) -> None:
        """A single-frame message: abort, flush, stats, or a slot state change."""
        msg = _control(raw)
        if type(msg) is scheduler_input.AbortRequest:
            ranks = [msg.dp_rank] if msg.dp_rank is not None else self._started_ranks()
            for rank in ranks:
                self.workers[rank].send(raw)
        elif type(msg) is scheduler_input.SetSlotState:
            self.dispatcher.set_state(msg.dp_rank, SlotState(msg.state))
            logger.info("DP rank %d is now %s", msg.dp_rank, msg.state)
        else:  # FlushCacheRequest, StatsRequest
            for rank in self._started_ranks():
                self.workers[rank].send(raw)

    def _started_ranks(self) -> list[int]:
        return [r for r in range(self.dispatcher.num_slots) if self.dispatcher.is_available(r)]

    def _dispatch_batch(self, head, bodies: list) -> None:
        """Place every request of a batch (one budget refresh) and forward each one's frame."""
        routes: list[RouteHeader] = _routes(head)
        if len(routes) != len(bodies):
            for route in routes:
                self._fail(route.rid, DispatchError(
                    f"malformed batch: {len(routes)} routing headers for {len(bodies)} "
                    "requests", 500))
            logger.error("dropped a batch with %d routing headers for %d requests",
                         len(routes), len(bodies))
            return
        # A RouteHeader has DispatchItem's fields (num_tokens, routed_dp_rank, bootstrap_room).
        for route, body, rank in zip(routes, bodies, self.dispatcher.place_batch(routes)):
            if isinstance(rank, DispatchError):
                self._fail(route.rid, rank)
                continue
            self.workers[rank].send(body, copy=False)
            self._dispatched(route.rid, rank)

    def _malformed(self, exc: Exception) -> None:
        logger.error("dropped a malformed message from the front end: %s", exc)

    def _dispatched(self, rid: str, rank: int) -> None:
        self._rids.append(rid)
        self._ranks.append(rank)
        self.num_dispatched += 1
        if self._report_due is None:
            self._report_pending()

    def _fail(self, rid: str, exc: DispatchError) -> None:
        self._failed.append(DispatchFailure(
            rid=rid, status=exc.status, message=exc.message, param=exc.param
        ))
        if self._report_due is None:
            self._report_pending()

    def _report_pending(self) -> None:
        self._report_due = time.monotonic() + REPORT_DELAY_MS / 1000
        self.recv.rcvtimeo = REPORT_DELAY_MS

    def flush_report(self) -> None:
        """Send the outcomes collected so far as one DispatchReport."""
        if self._rids or self._failed:
            report_msg = DispatchReport(rids=self._rids, ranks=self._ranks, failed=self._failed)
            self.to_frontend.send(frontend_input.encoder.encode(report_msg))
            self._rids, self._ranks, self._failed = [], [], []
        if self._report_due is not None:
            self._report_due = None
            self.recv.rcvtimeo = -1


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
