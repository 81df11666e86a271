"""`pdserve router`: run the router until SIGTERM/SIGINT.

Start-up: the HTTP port opens at once; workers become available as their first health checks
pass (`/readiness` says when). Shutdown: the port closes, in-flight requests get up to
SHUTDOWN_GRACE_S to finish, then the background loops stop and pooled connections close.
"""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from common.server.process_utils import configure_logging
from router.app import create_app
from router.config import RouterArgs
from router.state import RouterState

logger = logging.getLogger("pdserve.router")
SHUTDOWN_GRACE_S = 30.0


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's loop when it is installed (it cuts the router's per-request CPU, see
    docs/benchmarks.md, Router), else asyncio's own."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def run_router(args: RouterArgs) -> int:
    configure_logging(args.log_level, "router")
    state = RouterState(args)
    app = create_app(state)
    mode = "PD" if args.pd_disaggregation else "plain"
    logger.info("router (%s mode) on http://%s:%d; policies: prefill %s, decode %s, plain %s",
                mode, args.host, args.port, args.resolved_prefill_policy,
                args.resolved_decode_policy, args.policy)
    web.run_app(app, host=args.host, port=args.port, handler_cancellation=True,
                access_log=None, print=None, shutdown_timeout=SHUTDOWN_GRACE_S,
                loop=new_event_loop())
    return 0
