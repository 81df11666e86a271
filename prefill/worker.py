"""The prefill role inside one scheduler process: control channel + sender + queues, and the
rank's registration with the bootstrap server (retried until it answers, bounded)."""

from __future__ import annotations

import logging
import time
import urllib.error
import urllib.request

import msgspec
import zmq

from common.config import ServerArgs
from common.engine.engine import EngineCore
from common.messages.kv_bootstrap import KVAbort, KVRequest, RankRegistration
from common.messages.detokenizer_input import TokenDelta
from common.server.pd_control import ControlChannel, advertise_host, is_wildcard
from common.transfer.registry import make_sender, resolve_backend
from common.transfer.tcp import pool_layout
from prefill.queues import PrefillQueues, PrefillTimeouts

logger = logging.getLogger(__name__)

REGISTER_TIMEOUT = 60.0


def bootstrap_url(args: ServerArgs) -> str:
    """Where this service's bootstrap server listens, as seen from one of its ranks."""
    if args.nnodes > 1:
        host = args.dist_init_addr.rpartition(":")[0]
    else:
        host = "127.0.0.1" if is_wildcard(args.host) else args.host
    return f"http://{host}:{args.disaggregation_bootstrap_port}/route"


def register_rank(url: str, reg: RankRegistration, timeout: float = REGISTER_TIMEOUT) -> None:
    body = msgspec.json.encode(reg)
    deadline = time.monotonic() + timeout
    while True:
        request = urllib.request.Request(url, data=body, method="PUT",
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=5):
                return
        except urllib.error.HTTPError as exc:
            raise RuntimeError(f"the bootstrap server refused rank {reg.dp_rank}: "
                               f"{exc.read().decode(errors='replace')}") from None
        except OSError as exc:
            if time.monotonic() > deadline:
                raise RuntimeError(f"cannot register with the bootstrap server {url}: {exc}")
            time.sleep(0.1)


class PrefillRole:
    def __init__(self, args: ServerArgs, engine: EngineCore, ctx: zmq.Context):
        self.engine = engine
        self.channel = ControlChannel(ctx, args.host, advertise_host(args.host))
        self.backend = resolve_backend(args.disaggregation_transfer_backend, engine.pool)
        self.sender = make_sender(self.backend, engine.pool, args.disaggregation_transfer_timeout)
        self.queues = PrefillQueues(
            engine, self.sender, self.channel.send, args.num_dp_slots,
            PrefillTimeouts(bootstrap=args.disaggregation_bootstrap_timeout,
                            transferring=args.disaggregation_transfer_timeout),
        )
        layout = pool_layout(engine.pool)
        register_rank(bootstrap_url(args), RankRegistration(
            dp_rank=engine.dp_rank, control_endpoint=self.channel.endpoint,
            num_layers=layout.num_layers, page_size=layout.page_size,
            num_kv_heads=layout.num_kv_heads, head_dim=layout.head_dim, dtype=layout.dtype,
            transfer_backend=self.backend,
        ))

    @property
    def socket(self) -> zmq.Socket:
        return self.channel.pull

    def on_control(self) -> list[TokenDelta]:
        return self.channel.dispatch({KVRequest: self.queues.on_kv_request,
                                      KVAbort: self.queues.on_kv_abort})
