"""The prefill bootstrap server (registration, topology answers) and decode's prefill
directory (cache, compatibility check, heartbeat, dead peers), over real HTTP on loopback."""

from __future__ import annotations

import time
import urllib.request

import msgspec
import pytest

from common.messages.kv_bootstrap import RankRegistration
from common.transfer.base import KVLayout
from decode.prefill_directory import PeerState, PrefillDirectory
from prefill.bootstrap_server import BootstrapRegistry, BootstrapServer
from prefill.worker import register_rank
from server_utils import free_port, http_json

LAYOUT = KVLayout(num_layers=2, page_size=4, num_kv_heads=2, head_dim=8, dtype="torch.float32")


def reg(rank: int, page_size: int = 4, backend: str = "tcp") -> RankRegistration:
    return RankRegistration(dp_rank=rank, control_endpoint=f"127.0.0.1:{9000 + rank}",
                            num_layers=2, page_size=page_size, num_kv_heads=2, head_dim=8,
                            dtype="torch.float32", transfer_backend=backend)


@pytest.fixture
def server():
    # 3 slots, ranks 0 and 1 started (slot 2 reserved)
    srv = BootstrapServer(BootstrapRegistry(3, {0, 1}), "127.0.0.1", free_port())
    srv.start()
    yield srv
    srv.stop()


def url(srv, query=""):
    return f"http://127.0.0.1:{srv.port}/route{query}"


def put(srv, body: bytes) -> int:
    req = urllib.request.Request(url(srv), data=body, method="PUT")
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_topology_is_503_until_every_started_rank_registered(server):
    assert http_json(url(server))[0] == 503
    register_rank(url(server), reg(0))
    status, body = http_json(url(server))
    assert status == 503 and "[1]" in body["error"]["message"]
    assert http_json(url(server, "?prefill_dp_rank=1"))[0] == 503
    register_rank(url(server), reg(1))
    status, body = http_json(url(server))
    assert status == 200
    assert body["num_dp_slots"] == 3  # reserved slots count in the modulus
    assert body["transfer_backend"] == "tcp"
    assert sorted(body["ranks"]) == ["0", "1"]
    status, body = http_json(url(server, "?prefill_dp_rank=1"))
    assert status == 200 and body["control_endpoint"] == "127.0.0.1:9001"


def test_bad_queries_and_registrations_are_clear(server):
    assert http_json(url(server, "?prefill_dp_rank=x"))[0] == 400
    assert http_json(url(server, "?prefill_dp_rank=3"))[0] == 404
    assert http_json(url(server, "?rank=1"))[0] == 400
    assert put(server, b"{not json") == 400
    assert put(server, b'{"dp_rank": 0}') == 400
    assert put(server, msgspec.json.encode(reg(5))) == 400
    register_rank(url(server), reg(0))
    assert put(server, msgspec.json.encode(reg(1, page_size=16))) == 400  # layouts differ
    assert put(server, msgspec.json.encode(reg(1, backend="torch"))) == 400
    with pytest.raises(RuntimeError, match="refused"):
        register_rank(url(server), reg(1, page_size=16))


def wait_state(directory, srv_port, state, timeout=10.0):
    deadline = time.monotonic() + timeout
    while (entry := directory.lookup("127.0.0.1", srv_port)).state is not state:
        assert time.monotonic() < deadline, (entry.state, entry.error)
        time.sleep(0.02)
    return entry


def test_directory_caches_checks_and_heartbeats(server):
    directory = PrefillDirectory(LAYOUT, "tcp", heartbeat_interval=0.1, failure_threshold=2,
                                 fetch_timeout=1.0)
    try:
        entry = directory.lookup("127.0.0.1", server.port)
        time.sleep(0.3)
        assert entry.state is PeerState.PENDING and "not ready" in entry.error
        register_rank(url(server), reg(0))
        register_rank(url(server), reg(1))
        entry = wait_state(directory, server.port, PeerState.READY)
        assert entry.topology.num_dp_slots == 3
        server.stop()
        entry = wait_state(directory, server.port, PeerState.DEAD)
        assert "unreachable" in entry.error
    finally:
        directory.close()


def test_directory_reports_an_incompatible_prefill(server):
    register_rank(url(server), reg(0, page_size=16))
    register_rank(url(server), reg(1, page_size=16))
    directory = PrefillDirectory(LAYOUT, "tcp", heartbeat_interval=0.1)
    try:
        entry = wait_state(directory, server.port, PeerState.INCOMPATIBLE)
        assert "page_size" in entry.error
    finally:
        directory.close()
    directory = PrefillDirectory(
        KVLayout(2, 16, 2, 8, "torch.float32"), "torch", heartbeat_interval=0.1)
    try:
        entry = wait_state(directory, server.port, PeerState.INCOMPATIBLE)
        assert "transfer backend" in entry.error
    finally:
        directory.close()
