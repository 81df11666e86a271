"""Start, supervise and stop one service tree (dp_size == 1):

    launcher (this process): HTTP front end
      +-- scheduler process     (spawned; dies with the launcher via PDEATHSIG)
      +-- detokenizer process   (spawned; likewise)

Start-up: spawn both children, wait for each one's ready message (or its error, which is
printed and ends the launch), then open the HTTP port. While serving, a watchdog checks the
children; if one dies, every in-flight request fails with 503, the reason is logged, and the
service exits with status 1 (never a hang). SIGTERM/SIGINT: stop accepting (503), wait up to
--graceful-shutdown-timeout for in-flight requests, abort the rest, stop the children, exit 0.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import signal
import time
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path

from aiohttp import web

from common.config import ServerArgs
from common.engine.tokenizer import Tokenizer
from common.messages import launch
from common.server.context import ServerContext
from common.server.detokenizer_process import run_detokenizer_process
from common.server.frontend import FrontEnd
from common.server.http_app import create_app
from common.server.ipc import IpcPaths
from common.server.process_utils import configure_logging
from common.server.protocol import Limits
from common.server.dp_ranks import DpRanks
from common.server.metrics import ServiceMetrics
from common.server.scheduler_process import run_scheduler_process
from common.dp.controller import run_controller_process
from common.dp.dispatch import LOAD_AWARE, resolve_method
from common.loads.relay import bind_relay, relay_forever
from common.server.topology import Topology
from common.loads.board import LoadBoard

logger = logging.getLogger("pdserve")

STARTUP_TIMEOUT = 900.0
WATCHDOG_INTERVAL = 0.2


def resolve_model_path(args: ServerArgs) -> str:
    if args.model_path is not None:
        if not Path(args.model_path).is_dir():
            raise FileNotFoundError(f"--model-path {args.model_path} is not a folder")
        return args.model_path
    from common.model_store.default_model import ensure_default_model

    return str(ensure_default_model())


class ServiceTree:
    """The child processes of one service and the load board they share.

    Children: scheduler-k for each started DP rank k, the detokenizer, and with more than one
    DP slot the dp-controller. The launcher owns the board file and removes it on stop.
    """

    def __init__(self, args: ServerArgs, model_path: str):
        self.args = args
        self.model_path = model_path
        self.method, warning = resolve_method(args.load_balance_method, args.disaggregation_mode)
        if warning:
            logger.warning("%s", warning)
        self.uses_controller = args.num_dp_slots > 1
        self.topology = Topology.from_args(args)
        self.is_head = args.node_rank == 0
        self.ipc = IpcPaths.create()
        # Only node 0 has a board: other nodes relay their snapshots to it.
        self.board = LoadBoard.create(args.num_dp_slots) if self.is_head else None
        self.children: dict[str, BaseProcess] = {}
        self.scheduler_info: launch.SchedulerReady | None = None
        self.dead: set[str] = set()
        self.bootstrap = None  # prefill, node 0: where ranks register and decode asks

    def start_bootstrap_server(self) -> None:
        from prefill.bootstrap_server import BootstrapRegistry, BootstrapServer

        registry = BootstrapRegistry(self.args.num_dp_slots, set(range(self.args.dp_size)))
        self.bootstrap = BootstrapServer(registry, self.args.host,
                                         self.args.disaggregation_bootstrap_port)
        self.bootstrap.start()

    def start_children(self) -> None:
        logger.info(
            "starting %d DP rank(s) of %d slot(s); load balance method %s%s",
            self.args.dp_size, self.args.num_dp_slots, self.method,
            "" if self.uses_controller else " (no controller: a single rank)",
        )
        if self.is_head and self.args.disaggregation_mode == "prefill":
            self.start_bootstrap_server()
        ranks = [r for r in self.topology.local_ranks if r < self.args.dp_size]
        pending = [self._spawn_scheduler(rank) for rank in ranks]
        if self.is_head:
            pending.append(self._spawn("detokenizer", run_detokenizer_process,
                                       (self.args, self.model_path, self.ipc)))
        if self.is_head and self.uses_controller:
            pending.append(self._spawn(
                "dp-controller", run_controller_process,
                (self.args, self.method, self.ipc, self.board.path, self.board.board_id),
            ))
        deadline = time.monotonic() + STARTUP_TIMEOUT
        for name, reader in pending:
            self._expect_ready(name, reader, deadline)

    def start_scheduler(self, rank: int) -> None:
        """Start one more rank (elastic activation); blocks until it is ready."""
        name, reader = self._spawn_scheduler(rank)
        self.dead.discard(name)
        self._expect_ready(name, reader, time.monotonic() + STARTUP_TIMEOUT)

    def _spawn_scheduler(self, rank: int) -> tuple[str, Connection]:
        return self._spawn(
            f"scheduler-{rank}", run_scheduler_process,
            (self.args, self.model_path, self.ipc, rank,
             self.board.path if self.board else None, self.board.board_id if self.board else 0),
        )

    def _spawn(self, name: str, target, args: tuple) -> tuple[str, Connection]:
        mp = multiprocessing.get_context("spawn")
        reader, writer = mp.Pipe(duplex=False)
        proc = mp.Process(target=target, args=(*args, writer), name=f"pdserve-{name}",
                          daemon=True)
        proc.start()
        writer.close()
        self.children[name] = proc
        return name, reader

    def _expect_ready(self, name: str, reader: Connection, deadline: float) -> None:
        message = self._wait_ready(name, reader, deadline)
        if isinstance(message, launch.StartupFailed):
            raise RuntimeError(f"{message.name} failed to start: {message.error}")
        if isinstance(message, launch.SchedulerReady):
            self.scheduler_info = message

    def _wait_ready(self, name: str, reader: Connection, deadline: float) -> launch.LaunchMessage:
        proc = self.children[name]
        while time.monotonic() < deadline:
            if reader.poll(0.1):
                try:
                    return launch.decoder.decode(reader.recv_bytes())
                except EOFError:
                    break
            if not proc.is_alive():
                break
        proc.join(timeout=1)
        raise RuntimeError(f"{name} process exited during start-up (exit code {proc.exitcode})")

    @property
    def pids(self) -> dict[str, int]:
        return {name: p.pid for name, p in self.children.items()}

    def is_running(self, rank: int) -> bool:
        proc = self.children.get(f"scheduler-{rank}")
        return proc is not None and proc.is_alive()

    def newly_dead(self) -> list[tuple[str, str]]:
        """(name, reason) of children that died since the last call."""
        found = []
        for name, proc in self.children.items():
            if name not in self.dead and not proc.is_alive():
                self.dead.add(name)
                found.append(
                    (name, f"{name} process (pid {proc.pid}) died with exit code {proc.exitcode}")
                )
        return found

    def is_fatal(self, name: str) -> bool:
        """Losing a scheduler is survivable while other ranks serve; anything else is not."""
        return not (name.startswith("scheduler-") and self.uses_controller)

    def stop(self) -> None:
        for proc in self.children.values():
            if proc.is_alive():
                proc.terminate()
        for proc in self.children.values():
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        if self.bootstrap is not None:
            self.bootstrap.stop()
        if self.board is not None:
            self.board.unlink()
        self.ipc.remove()


async def serve_http(tree: ServiceTree, tokenizer: Tokenizer) -> int:
    args, info = tree.args, tree.scheduler_info
    board = tree.board
    metrics = ServiceMetrics(board.read_all)
    if tree.uses_controller:
        frontend = FrontEnd(tree.ipc, tree.ipc.controller_input, args.dp_size,
                            via_controller=True, on_finish=metrics.on_finish)
    else:
        frontend = FrontEnd(tree.ipc, tree.ipc.scheduler_input_of(0), on_finish=metrics.on_finish)
    frontend.start()
    relay_task = None
    if tree.topology.multi_node and tree.method not in LOAD_AWARE:
        # The front end owns the load relay PULL when the controller does not need loads.
        relay_sock = bind_relay(frontend.ctx, tree.topology.load_relay)
        relay_task = asyncio.create_task(relay_forever(relay_sock, board))
    dp = DpRanks(
        method=tree.method,
        num_active=args.dp_size,
        num_slots=args.num_dp_slots,
        board=board,
        frontend=frontend,
        uses_controller=tree.uses_controller,
        start_scheduler=tree.start_scheduler,
        is_running=tree.is_running,
        remote_ranks=frozenset(r for r in range(args.num_dp_slots)
                               if not tree.topology.on_node0(r)),
    )
    ctx = ServerContext(
        args=args,
        model_path=tree.model_path,
        model_name=args.served_model_name or Path(tree.model_path).name,
        tokenizer=tokenizer,
        frontend=frontend,
        info=info,
        limits=Limits(info.vocab_size, info.context_length, info.max_total_tokens),
        dp=dp,
        metrics=metrics,
        process_pids=lambda: tree.pids,
    )
    runner = web.AppRunner(create_app(ctx), handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, args.host, args.port).start()
    logger.info("pdserve ready: http://%s:%d (model %s)", args.host, args.port, ctx.model_name)

    stop = asyncio.Event()
    exit_code = 0
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    async def watchdog() -> None:
        nonlocal exit_code
        while True:
            await asyncio.sleep(WATCHDOG_INTERVAL)
            if dp.remote_ranks:
                try:
                    dp.check_remote_ranks(args.remote_rank_timeout, time.monotonic())
                except Exception:  # never the end of the supervision below
                    logger.exception("checking the other nodes' DP ranks failed")
            if frontend.fatal_reason is not None:
                logger.critical("%s; shutting the service down", frontend.fatal_reason)
                ctx.unhealthy_reason = frontend.fatal_reason
                exit_code = 1
                stop.set()
                return
            for name, reason in tree.newly_dead():
                if tree.is_fatal(name):
                    logger.critical("%s; shutting the service down", reason)
                    ctx.unhealthy_reason = reason
                    frontend.fail_all(reason)
                    exit_code = 1
                    stop.set()
                    return
                logger.error("%s; its DP rank is now unavailable", reason)
                rank = int(name.removeprefix("scheduler-"))
                dp.mark_dead(rank, reason)
                if tree.bootstrap is not None:
                    tree.bootstrap.registry.forget(rank)

    watch = asyncio.create_task(watchdog())
    await stop.wait()
    watch.cancel()
    if exit_code == 0:
        ctx.draining = True
        deadline = time.monotonic() + args.graceful_shutdown_timeout
        if frontend.num_inflight:
            logger.info("draining %d in-flight requests", frontend.num_inflight)
        while frontend.num_inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if frontend.num_inflight:
            logger.warning("aborting %d requests still running", frontend.num_inflight)
            frontend.fail_all("the server is shutting down")
            await asyncio.sleep(0.1)  # let handlers answer their clients
    await runner.cleanup()
    if relay_task is not None:
        relay_task.cancel()
    await frontend.close()
    return exit_code


def serve_worker_node(tree: ServiceTree) -> int:
    """Node k > 0: only this node's schedulers, connected to node 0; no HTTP port. Runs until
    SIGTERM/SIGINT or until one of its schedulers dies (exit status 1)."""
    stopping = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.append(True))
    logger.info("node %d serving DP ranks %s for %s", tree.args.node_rank,
                list(tree.topology.local_ranks), tree.args.dist_init_addr)
    while not stopping:
        for _name, reason in tree.newly_dead():
            logger.critical("%s; stopping this node", reason)
            return 1
        time.sleep(WATCHDOG_INTERVAL)
    return 0


def serve(args: ServerArgs) -> int:
    configure_logging(args.log_level, "pdserve")
    try:
        model_path = resolve_model_path(args)
    except (FileNotFoundError, RuntimeError) as exc:
        logger.error("%s", exc)
        return 2
    tree = ServiceTree(args, model_path)
    try:
        tree.start_children()
        if not tree.is_head:
            return serve_worker_node(tree)
        tokenizer = Tokenizer.from_model_path(model_path)
        return asyncio.run(serve_http(tree, tokenizer))
    except RuntimeError as exc:
        logger.error("%s", exc)
        return 1
    finally:
        tree.stop()
        logger.info("pdserve stopped")
