"""The PD control channel of one scheduler process: a ZMQ PULL bound on TCP (its address is
this rank's control endpoint) and a cache of PUSH sockets to peers' endpoints.

Sends never block: a peer that is gone or slow makes `send` return False (the caller fails the
request), instead of stalling the scheduler. Nothing is pickled: messages are the msgspec
Structs of `common/messages/kv_bootstrap.py`.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable

import msgspec
import zmq

from common.messages import kv_bootstrap

logger = logging.getLogger(__name__)


def is_wildcard(host: str) -> bool:
    """A bind address meaning every interface, which peers cannot dial as such."""
    return host in ("0.0.0.0", "::", "")


def advertise_host(bind_host: str) -> str:
    """The address peers use to reach this machine: the bind address unless it is a wildcard,
    then this host's name resolved (a pod IP on Kubernetes)."""
    if not is_wildcard(bind_host):
        return bind_host
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


class ControlChannel:
    def __init__(self, ctx: zmq.Context, bind_host: str, advertise: str):
        self.ctx = ctx
        self.pull = ctx.socket(zmq.PULL)
        port = self.pull.bind_to_random_port(f"tcp://{bind_host}")
        self.endpoint = f"{advertise}:{port}"
        self._peers: dict[str, zmq.Socket] = {}

    def send(self, endpoint: str, msg) -> bool:
        sock = self._peers.get(endpoint)
        if sock is None:
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 10_000)
            sock.connect(f"tcp://{endpoint}")
            self._peers[endpoint] = sock
        try:
            sock.send(kv_bootstrap.encoder.encode(msg), zmq.NOBLOCK)
            return True
        except zmq.Again:
            logger.warning("control message to %s dropped: the peer is not keeping up", endpoint)
            return False

    def dispatch(self, handlers: dict[type, Callable[[object], list]]) -> list:
        """Every waiting message to the handler of its type; their outputs concatenated."""
        out: list = []
        for msg in self.receive():
            handler = handlers.get(type(msg))
            if handler is not None:
                out += handler(msg)
        return out

    def receive(self) -> list:
        out = []
        while True:
            try:
                raw = self.pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                return out
            try:
                out.append(kv_bootstrap.decoder.decode(raw))
            except msgspec.DecodeError as exc:  # a foreign message must not end the rank
                logger.warning("ignored an undecodable control message: %s", exc)

    def close(self) -> None:
        for sock in self._peers.values():
            sock.close(linger=0)
        self.pull.close(linger=0)
