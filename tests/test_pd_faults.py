"""PD failures with real processes: a peer killed in each phase, a client that leaves, a
mis-set prefill. Every wait is bounded by a short timeout here; the request fails with a clear
error naming the phase, the surviving side's KV pool returns to its starting count, and it
keeps serving."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import aiohttp
import pytest

from server_utils import ServerProcess, free_port
from test_pd_service import greedy, post, wait_for_load

TIMEOUTS = ("--disaggregation-bootstrap-timeout", "3", "--disaggregation-waiting-timeout", "3",
            "--disaggregation-transfer-timeout", "3",
            "--disaggregation-heartbeat-interval", "0.3")
COMMON = ("--max-total-tokens", "1024", "--torch-num-threads", "1", "--page-size", "4",
          *TIMEOUTS)
PROMPT = list(range(10, 30))


def prefill(model_dir, *extra) -> ServerProcess:
    port = free_port()
    server = ServerProcess(model_dir, *COMMON, "--disaggregation-bootstrap-port", str(port),
                           *extra, command="prefill")
    server.bootstrap_port = port
    return server


def decode(model_dir, *extra) -> ServerProcess:
    return ServerProcess(model_dir, *COMMON, *extra, command="decode")


def body(server: ServerProcess, room: int, rid: str | None = None) -> dict:
    out = {"input_ids": PROMPT, "sampling_params": greedy(4), "bootstrap_host": "127.0.0.1",
           "bootstrap_port": server.bootstrap_port, "bootstrap_room": room}
    if rid:
        out["rid"] = rid
    return out


def kill(server: ServerProcess) -> None:
    os.killpg(server.proc.pid, signal.SIGKILL)
    server.proc.wait(10)


def pool_whole(server: ServerProcess) -> None:
    stats = server.wait_pool_whole()
    assert stats["num_free_pages"] == stats["num_total_pages"], stats


@pytest.fixture
async def session():
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        yield s


async def test_prefill_dead_before_indices_then_a_new_prefill_serves(tiny_llama_dir, session):
    with decode(tiny_llama_dir) as d:
        with prefill(tiny_llama_dir) as gone:
            pass  # stopped: its bootstrap server is unreachable
        start = time.monotonic()
        status, err = await post(session, d.url + "/generate", body(gone, 11))
        assert status == 503, err
        assert "phase bootstrap" in err["error"]["message"]
        assert "unreachable" in err["error"]["message"]
        assert time.monotonic() - start < 10  # bounded (the message shows heartbeat detection)
        pool_whole(d)
        with prefill(tiny_llama_dir) as p:
            (ps, _), (ds, out) = await asyncio.gather(
                post(session, p.url + "/generate", body(p, 12)),
                post(session, d.url + "/generate", body(p, 12)))
            assert (ps, ds) == (200, 200) and len(out["output_ids"]) == 4
            pool_whole(p)
        pool_whole(d)


async def test_prefill_killed_while_decode_waits_for_kv(tiny_llama_dir, session):
    with decode(tiny_llama_dir) as d, prefill(tiny_llama_dir) as p:
        waiting = asyncio.create_task(post(session, d.url + "/generate", body(p, 21)))
        await wait_for_load(session, d.url, "num_transfer_reqs", 1)
        kill(p)  # as if prefill died during its forward: decode's indices were sent
        start = time.monotonic()
        status, err = await waiting
        assert status in (503, 504), err
        assert "waiting_for_input" in err["error"]["message"]
        assert time.monotonic() - start < 10
        pool_whole(d)
        status, _ = await post(session, d.url + "/health_generate", {})
        assert (await session.get(d.url + "/health")).status == 200


async def test_decode_killed_prefill_times_out_and_frees(tiny_llama_dir, session):
    with prefill(tiny_llama_dir) as p:
        with decode(tiny_llama_dir) as d:
            waiting = asyncio.create_task(post(session, p.url + "/generate", body(p, 31)))
            await wait_for_load(session, p.url, "num_bootstrap_reqs", 1)
            kill(d)
        status, err = await waiting
        assert status == 504 and "phase bootstrap" in err["error"]["message"]
        pool_whole(p)


async def test_client_leaving_decode_releases_the_room_on_both_sides(tiny_llama_dir, session):
    with decode(tiny_llama_dir) as d, prefill(tiny_llama_dir) as p:
        leaving = asyncio.create_task(post(session, d.url + "/generate", body(p, 41)))
        await wait_for_load(session, d.url, "num_transfer_reqs", 1)
        leaving.cancel()  # the client disconnects
        await asyncio.gather(leaving, return_exceptions=True)
        await wait_for_load(session, d.url, "num_transfer_reqs", 0)
        pool_whole(d)
        # A late prefill request for the room never computes for nobody: if decode's KVAbort
        # got to prefill first, the request finds no destination and ends at its bootstrap
        # timeout; if the request got there first (the abort travels on its own), the abort
        # fails it. Either way, a clear error and no KV held.
        status, err = await post(session, p.url + "/generate", body(p, 41))
        message = err["error"]["message"]
        assert (status == 504 and "phase bootstrap" in message) or (
            status == 502 and "decode gave up" in message), (status, err)
        pool_whole(p)


async def test_mis_set_prefill_is_reported_not_hung(tiny_llama_dir, session):
    """A prefill whose controller ignores the room (total_requests here: idle ranks tie and
    everything goes to rank 0) must not leave decode waiting forever."""
    with prefill(tiny_llama_dir, "--dp-size", "2", "--load-balance-method",
                 "total_requests") as p, decode(tiny_llama_dir) as d:
        room = 51  # odd: belongs to prefill rank 1, but lands on rank 0
        start = time.monotonic()
        (ps, perr), (ds, derr) = await asyncio.gather(
            post(session, p.url + "/generate", body(p, room)),
            post(session, d.url + "/generate", body(p, room)))
        assert ps == 503 and "follow_bootstrap_room" in perr["error"]["message"]
        # decode hears it from prefill rank 1 (which never got the request) or times out
        # waiting for the KV, whichever comes first; either way it names the room and rank
        assert ds in (502, 504), derr
        message = derr["error"]["message"]
        assert "never received the request" in message or (
            "waiting_for_input" in message and "prefill rank 1" in message), message
        assert time.monotonic() - start < 15
        pool_whole(p)
        pool_whole(d)
