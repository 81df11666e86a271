"""The DataParallelController process: a thin loop around `Dispatcher`.

    front end connection   [RouteHeader, request]            one request
    (Unix stream socket,   [list[RouteHeader], request x N]  one HTTP batch (one budget refresh)
     frame_stream)         [AbortRequest | FlushCacheRequest | StatsRequest | SetSlotState]
      -> Dispatcher picks a rank from the header frame  -> ZMQ PUSH scheduler_input[rank]: the
                                                           request frame's bytes, unchanged
      -> DispatchReport (rids, ranks, failures)         -> ZMQ PUSH frontend_input
    replies go scheduler -> detokenizer -> front end, never through here.
    ZMQ PULL load relay (multi-node, load-aware methods only): other nodes' snapshots -> board

The front end builds these messages with `scheduler_input.controller_frames` and writes them to
a Unix stream socket that this process reads in its own thread (`common/server/frame_stream.py`
says why that leg is not ZMQ: one relay hop costs three thread wakeups with ZMQ, one without).
The frame count says what a message is (1: control, 2: one request, more: a batch); only the
small header frame is decoded (rid, num_tokens, routed_dp_rank, bootstrap_room), and the
request frame is sent on as it arrived, so a dispatch costs the same whatever the prompt's
length. Schedulers receive plain single-frame GenerateRequests, exactly as with dp_size 1.

It blocks on one poller (the listening socket, the front end's connection, the load relay when
it owns one) and survives every per-request error: a request that cannot be placed gets a
DispatchFailure (HTTP 4xx/503 for that client only); a malformed message is logged and dropped
(its requests, when their rids can be read, are failed); a connection whose byte stream does
not parse is closed (a stream cannot be resynchronised), and one that closes is forgotten.

Reports are off the forwarding path: a request's hop is just header decode -> Dispatcher -> send.
Outcomes are collected and sent as one DispatchReport once the oldest is REPORT_DELAY_MS old
(checked after each wakeup; a quiet input times the poll out after as long again, so a report
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
import select
import socket
import struct
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
from common.server import frame_stream
from common.server.frame_stream import FrameReader, FrameStreamError
from common.server.ipc import IpcPaths, drain_nowait
from common.server.topology import Topology
from common.server.process_utils import configure_logging, die_with_parent, report

logger = logging.getLogger(__name__)

# When dispatch outcomes go to the front end (see the module docstring).
REPORT_DELAY_MS = 10
REPORT_MAX_ITEMS = 512
# With one input connection, how often the controller looks for another one.
ACCEPT_CHECK_MS = 200

_route = scheduler_input.route_decoder.decode
_routes = scheduler_input.batch_route_decoder.decode
_control = scheduler_input.control_decoder.decode


def _set_receive_timeout(sock: socket.socket, ms: int) -> None:
    """SO_RCVTIMEO: a blocking recv() gives up after `ms` (0: never)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO,
                    struct.pack("ll", ms // 1000, ms % 1000 * 1000))


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
        # The front end's connection(s): see common/server/frame_stream.py for why not ZMQ.
        self.listener = frame_stream.listen(ipc.controller_input)
        self.listener.setblocking(False)
        self.readers: dict[int, FrameReader] = {}  # by file descriptor
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
        # Only a ZMQ socket (the load relay) needs zmq's poller; plain file descriptors wake
        # a little faster through the system's poll. Both take (fd, POLLIN), poll(ms | None).
        self.poller = zmq.Poller() if self.relay is not None else select.poll()
        self.poller.register(self.listener.fileno(), select.POLLIN)
        if self.relay is not None:
            self.poller.register(self.relay, select.POLLIN)
        self.to_frontend = self.ctx.socket(zmq.PUSH)
        self.to_frontend.connect(ipc.frontend_input)
        self.num_dispatched = 0
        # Dispatch outcomes not yet reported to the front end, and when they must go at the latest.
        self._rids: list[str] = []
        self._ranks: list[int] = []
        self._failed: list[DispatchFailure] = []
        self._report_due: float | None = None

    def run_forever(self) -> None:
        while True:
            if self.relay is None and len(self.readers) == 1:
                self._serve_sole_connection()
            else:
                self._poll_once()

    def _poll_once(self) -> None:
        """Block on the poller (input connections, the listener, the load relay); read what
        every ready connection has and handle each complete message."""
        events = self.poller.poll(REPORT_DELAY_MS if self._report_due is not None else None)
        if not events:
            self.flush_report()  # quiet: time to report
            return
        for source, _ in events:  # a file descriptor, or the relay's zmq socket
            reader = self.readers.get(source)
            if reader is not None:
                self.handle_messages(self._read(reader) or ())
            elif source == self.listener.fileno():
                self._accept()
            else:
                for raw in drain_nowait(self.relay):
                    write_relayed(self.relay_board, raw)
        self._report_if_due()

    def _serve_sole_connection(self) -> None:
        """The usual case, one front end and no load relay: wait in a blocking recv() on its
        connection, one system call per wakeup where poll() + recv() are two. A kernel receive
        timeout (SO_RCVTIMEO, set only when the report state changes, not per wakeup) ends the
        wait when reports are due; every ACCEPT_CHECK_MS, busy or idle, the listener is asked
        for another connection without blocking. Returns when the connection closes or another
        one arrives (then the poller serves them all)."""
        (reader,) = self.readers.values()
        sock = reader.sock
        sock.setblocking(True)
        handle = self.handle_messages
        monotonic = time.monotonic
        timeout_ms = None
        next_accept_check = monotonic() + ACCEPT_CHECK_MS / 1000
        while True:
            wanted = ACCEPT_CHECK_MS
            if self._report_due is not None:
                wanted = min(wanted, REPORT_DELAY_MS)
            if wanted != timeout_ms:
                timeout_ms = wanted
                _set_receive_timeout(sock, wanted)
            messages = self._read(reader)  # [] after the timeout (or a partial message)
            if messages is None:  # the connection closed
                return
            if messages:
                handle(messages)
            self._report_if_due()
            if monotonic() >= next_accept_check:
                next_accept_check = monotonic() + ACCEPT_CHECK_MS / 1000
                if self._accept():
                    _set_receive_timeout(sock, 0)  # none: the poller serves it from now on
                    sock.setblocking(False)
                    return

    def handle_messages(self, messages: list) -> None:
        """Messages from the front end, in order; the frame count says what each is (1:
        control, 2: one request, more: a batch). The one-request case is inlined: every step
        of it is on the request's hop."""
        place = self.dispatcher.place
        for frames in messages:
            try:
                if len(frames) == 2:
                    head, body = frames
                    route = _route(head)
                    try:
                        rank = place(route.num_tokens, route.routed_dp_rank, route.bootstrap_room)
                    except DispatchError as exc:
                        self._fail(route.rid, exc)
                    else:
                        self.workers[rank].send(body)  # copied: the frame is a view
                        self._dispatched(route.rid, rank)
                elif len(frames) == 1:
                    self.handle_control(frames[0])
                else:
                    self._dispatch_batch(frames[0], frames[1:])
            except msgspec.DecodeError as exc:
                self._malformed(exc)
            except Exception:  # one message the loop cannot handle never stops the others
                logger.exception("dropped a message from the front end")

    def _report_if_due(self) -> None:
        due = self._report_due
        if due is not None and (self._failed or time.monotonic() >= due):
            self.flush_report()

    def _accept(self) -> bool:
        """Accept a waiting connection; False if none is waiting (the listener never blocks)."""
        try:
            sock, _ = self.listener.accept()
        except (BlockingIOError, InterruptedError):
            return False
        reader = FrameReader(sock)
        self.readers[sock.fileno()] = reader
        self.poller.register(sock.fileno(), select.POLLIN)
        return True

    def _read(self, reader: FrameReader) -> list | None:
        """The messages one read completes; None when the connection closed or its stream is
        corrupt (it is dropped)."""
        try:
            messages = reader.read()
        except FrameStreamError as exc:
            logger.error("dropped a front end connection with a corrupt stream: %s", exc)
            messages = None
        if messages is None:
            self.poller.unregister(reader.sock.fileno())
            del self.readers[reader.sock.fileno()]
            reader.sock.close()
        return messages

    # ---- message handling ----------------------------------------------------------------
    def handle_control(self, raw: bytes) -> None:
        """A single-frame message: abort, flush, stats, or a slot state change."""
        msg = _control(raw)
        if type(msg) is scheduler_input.AbortRequest:
            known = msg.dp_rank is not None and 0 <= msg.dp_rank < len(self.workers)
            ranks = [msg.dp_rank] if known else self._started_ranks()
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
            self.workers[rank].send(body)
            self._dispatched(route.rid, rank)

    def _malformed(self, exc: Exception) -> None:
        logger.error("dropped a malformed message from the front end: %s", exc)

    def _dispatched(self, rid: str, rank: int) -> None:
        self._rids.append(rid)
        self._ranks.append(rank)
        self.num_dispatched += 1
        if self._report_due is None:
            self._report_pending()
        if len(self._rids) >= REPORT_MAX_ITEMS:
            self.flush_report()

    def _fail(self, rid: str, exc: DispatchError) -> None:
        self._failed.append(DispatchFailure(
            rid=rid, status=exc.status, message=exc.message, param=exc.param
        ))
        if self._report_due is None:
            self._report_pending()

    def _report_pending(self) -> None:
        self._report_due = time.monotonic() + REPORT_DELAY_MS / 1000

    def flush_report(self) -> None:
        """Send the outcomes collected so far as one DispatchReport."""
        if self._rids or self._failed:
            report_msg = DispatchReport(rids=self._rids, ranks=self._ranks, failed=self._failed)
            self.to_frontend.send(frontend_input.encoder.encode(report_msg))
            self._rids, self._ranks, self._failed = [], [], []
        self._report_due = None


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
