"""The scheduler process: a ZMQ loop around `EngineCore`.

    PULL scheduler_input  (GenerateRequest | AbortRequest | FlushCacheRequest)
      -> engine.add / abort / flush_cache
      -> engine.step() while there is work
    PUSH detokenizer_input (TokenBatch | FlushCacheResult)

When idle it blocks on the poller (no busy loop). An exception inside the engine ends the
process: the launcher notices the death and takes the whole service down with a log line.
"""

from __future__ import annotations

import logging
import traceback
from multiprocessing.connection import Connection

import torch
import zmq

from common.config import ServerArgs
from common.engine.engine import EngineCore
from common.engine.loader import load_engine_parts
from common.engine.tokenizer import Tokenizer
from common.messages import detokenizer_input, launch, scheduler_input
from common.server.ipc import IpcPaths
from common.server.process_utils import configure_logging, die_with_parent, report

logger = logging.getLogger(__name__)


class SchedulerLoop:
    def __init__(self, engine: EngineCore, ipc: IpcPaths):
        self.engine = engine
        self.ctx = zmq.Context()
        self.recv = self.ctx.socket(zmq.PULL)
        self.recv.bind(ipc.scheduler_input)
        self.send = self.ctx.socket(zmq.PUSH)
        self.send.connect(ipc.detokenizer_input)
        self.poller = zmq.Poller()
        self.poller.register(self.recv, zmq.POLLIN)

    def run_forever(self) -> None:
        while True:
            timeout = 0 if self.engine.has_work() else None
            if self.poller.poll(timeout):
                self._drain_inputs()
            deltas = self.engine.step()
            self._emit(deltas)

    def _drain_inputs(self) -> None:
        while True:
            try:
                raw = self.recv.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            msg = scheduler_input.decoder.decode(raw)
            if isinstance(msg, scheduler_input.GenerateRequest):
                self._emit(self.engine.add(msg))
            elif isinstance(msg, scheduler_input.AbortRequest):
                self._emit(self.engine.abort(msg.rid, msg.message))
            elif isinstance(msg, scheduler_input.FlushCacheRequest):
                ok, text = self.engine.flush_cache()
                result = detokenizer_input.FlushCacheResult(
                    request_id=msg.request_id, success=ok, message=text
                )
                self.send.send(detokenizer_input.encoder.encode(result))
            elif isinstance(msg, scheduler_input.StatsRequest):
                self.send.send(detokenizer_input.encoder.encode(self.engine.stats(msg.request_id)))

    def _emit(self, deltas: list) -> None:
        if deltas:
            batch = detokenizer_input.TokenBatch(deltas=deltas)
            self.send.send(detokenizer_input.encoder.encode(batch))


def run_scheduler_process(
    args: ServerArgs, model_path: str, ipc: IpcPaths, ready: Connection
) -> None:
    die_with_parent()
    configure_logging(args.log_level, "scheduler")
    try:
        if args.torch_num_threads:
            torch.set_num_threads(args.torch_num_threads)
        loaded = load_engine_parts(args, model_path)
        engine = EngineCore(args, loaded, Tokenizer.from_model_path(model_path))
        loop = SchedulerLoop(engine, ipc)
    except Exception as exc:  # start-up errors go back to the launcher, which prints them
        logger.debug("start-up failed:\n%s", traceback.format_exc())
        report(ready, launch.StartupFailed(name="scheduler", error=f"{type(exc).__name__}: {exc}"))
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
    try:
        loop.run_forever()
    except Exception:
        logger.critical("scheduler crashed:\n%s", traceback.format_exc())
        raise SystemExit(1) from None
