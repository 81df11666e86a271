"""The decode role inside one scheduler process: control channel, KV receiver, the prefill
directory and the queues."""

from __future__ import annotations

import zmq

from common.config import ServerArgs
from common.engine.engine import EngineCore
from common.messages.detokenizer_input import TokenDelta
from common.messages.kv_bootstrap import KVStatus
from common.server.pd_control import ControlChannel, advertise_host
from common.transfer.registry import make_receiver, resolve_backend
from common.transfer.tcp import pool_layout
from decode.prefill_directory import PrefillDirectory
from decode.queues import DecodeQueues, DecodeTimeouts


class DecodeRole:
    def __init__(self, args: ServerArgs, engine: EngineCore, ctx: zmq.Context):
        host = advertise_host(args.host)
        self.channel = ControlChannel(ctx, args.host, host)
        self.backend = resolve_backend(args.disaggregation_transfer_backend, engine.pool)
        self.receiver = make_receiver(self.backend, engine.pool, host,
                                      args.disaggregation_transfer_timeout)
        self.directory = PrefillDirectory(pool_layout(engine.pool), self.backend,
                                          args.disaggregation_heartbeat_interval)
        self.queues = DecodeQueues(
            engine, self.receiver, self.directory, self.channel.send, self.channel.endpoint,
            DecodeTimeouts(bootstrap=args.disaggregation_bootstrap_timeout,
                           waiting_for_input=args.disaggregation_waiting_timeout,
                           transferring=args.disaggregation_transfer_timeout),
        )

    @property
    def socket(self) -> zmq.Socket:
        return self.channel.pull

    def on_control(self) -> list[TokenDelta]:
        return self.channel.dispatch({KVStatus: self.queues.on_status})
