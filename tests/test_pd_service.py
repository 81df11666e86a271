"""PD end to end with real processes: `pdserve prefill` (dp 2) and `pdserve decode` (dp 2)
on loopback, each request sent to both with the bootstrap fields a router would inject.
Greedy output must equal a colocated service's, token for token."""

from __future__ import annotations

import asyncio
import json
import random

import aiohttp
import pytest

from pd_services import PDDeployment

def rooms(n=None):
    if n is None:
        return random.getrandbits(63)
    return [random.getrandbits(63) for _ in range(n)]


async def post(session, url, body):
    async with session.post(url, json=body) as resp:
        return resp.status, await resp.json()


async def post_stream(session, url, body):
    events = []
    async with session.post(url, json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            line = line.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return events


async def pd_call(session, pd: PDDeployment, path: str, body: dict, stream=False):
    """The same body to prefill and decode concurrently; returns (prefill, decode) answers."""
    call = post_stream if stream else post
    return await asyncio.gather(call(session, pd.prefill.url + path, body),
                                call(session, pd.decode.url + path, body))


def greedy(n, **kw):
    return {"max_new_tokens": n, "temperature": 0, "ignore_eos": True, **kw}


def assert_pools_whole(pd: PDDeployment):
    for server in (pd.prefill, pd.decode):
        stats = server.wait_pool_whole()
        assert stats["num_free_pages"] == stats["num_total_pages"], stats


@pytest.fixture
async def session():
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
        yield s


SHORT = [5, 6, 7, 8, 9]  # inside one 16-token page
LONG = list(range(10, 50))  # three pages


@pytest.mark.parametrize("deployment", ["pd_tcp", "pd_torch"])
async def test_generate_equals_colocated(deployment, request, session):
    pd = request.getfixturevalue(deployment)
    for prompt in (SHORT, LONG):
        body = {"input_ids": prompt, "sampling_params": greedy(12)}
        _, want = await post(session, pd.colocated.url + "/generate", body)
        (ps, pre), (ds, dec) = await pd_call(session, pd, "/generate",
                                             {**body, **pd.pd_fields(rooms())})
        assert (ps, ds) == (200, 200), (pre, dec)
        assert dec["output_ids"] == want["output_ids"]
        assert dec["text"] == want["text"]
        assert pre["output_ids"] == want["output_ids"][:1]
    # batch: one room per prompt; the rooms spread over both prefill ranks
    body = {"input_ids": [SHORT, LONG, LONG[3:], SHORT * 3], "sampling_params": greedy(8)}
    _, want = await post(session, pd.colocated.url + "/generate", body)
    batch_rooms = [2 * (r >> 1) for r in rooms(2)] + [2 * (r >> 1) + 1 for r in rooms(2)]
    (ps, _), (ds, dec) = await pd_call(session, pd, "/generate",
                                       {**body, **pd.pd_fields(batch_rooms)})
    assert (ps, ds) == (200, 200)
    assert [d["output_ids"] for d in dec] == [w["output_ids"] for w in want]
    assert {d["meta_info"]["dp_rank"] for d in dec} == {0, 1}  # decode round-robins
    assert_pools_whole(pd)


@pytest.mark.parametrize("deployment", ["pd_tcp", "pd_torch"])
async def test_streaming_equals_colocated(deployment, request, session):
    pd = request.getfixturevalue(deployment)
    body = {"input_ids": LONG, "sampling_params": greedy(10), "stream": True}
    want = (await post_stream(session, pd.colocated.url + "/generate", body))[-1]
    _, events = await pd_call(session, pd, "/generate", {**body, **pd.pd_fields(rooms())},
                              stream=True)
    assert len(events) >= 2
    assert events[-1]["output_ids"] == want["output_ids"]
    assert events[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 10}


async def test_openai_routes_and_n_samples(pd_tcp, session):
    pd = pd_tcp
    body = {"prompt": [SHORT, LONG], "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "n": 2}
    _, want = await post(session, pd.colocated.url + "/v1/completions", body)
    (ps, _), (ds, got) = await pd_call(session, pd, "/v1/completions",
                                       {**body, **pd.pd_fields(rooms(4))})
    assert (ps, ds) == (200, 200), got
    assert [c["text"] for c in got["choices"]] == [c["text"] for c in want["choices"]]
    chat = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 8,
            "temperature": 0}
    _, want = await post(session, pd.colocated.url + "/v1/chat/completions", chat)
    (ps, _), (ds, got) = await pd_call(session, pd, "/v1/chat/completions",
                                       {**chat, **pd.pd_fields(rooms())})
    assert (ps, ds) == (200, 200), got
    assert got["choices"][0]["message"] == want["choices"][0]["message"]
    _, events = await pd_call(session, pd, "/v1/chat/completions",
                              {**chat, "stream": True, **pd.pd_fields(rooms())}, stream=True)
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    assert text == want["choices"][0]["message"]["content"]


async def test_missing_fields_and_duplicate_rooms_are_refused(pd_tcp, session):
    pd = pd_tcp
    body = {"input_ids": SHORT, "sampling_params": greedy(2)}
    status, err = await post(session, pd.prefill.url + "/generate", body)
    assert status == 400 and err["error"]["param"] == "bootstrap_room"
    status, err = await post(session, pd.decode.url + "/generate",
                             {**body, "bootstrap_room": 1})
    assert status == 400 and err["error"]["param"] == "bootstrap_host"
    status, err = await post(session, pd.decode.url + "/generate",
                             {**body, **pd.pd_fields([1, 1]), "input_ids": [SHORT, SHORT]})
    assert status == 400 and "its own bootstrap_room" in err["error"]["message"]
    status, err = await post(session, pd.prefill.url + "/generate",
                             {**body, **pd.pd_fields([1, 2, 3])})
    assert status == 400 and err["error"]["param"] == "bootstrap_room"

    # a room in flight (decode waits for prefill, which never gets the request) is a 409
    room = rooms()
    waiting = asyncio.create_task(post(session, pd.decode.url + "/generate",
                                       {**body, "rid": "held", **pd.pd_fields(room)}))
    await wait_for_load(session, pd.decode.url, "num_transfer_reqs", 1)
    status, err = await post(session, pd.decode.url + "/generate",
                             {**body, **pd.pd_fields(room)})
    assert status == 409 and err["error"]["param"] == "bootstrap_room"
    status, _ = await post(session, pd.decode.url + "/abort_request", {"rid": "held"})
    assert status == 200
    await waiting
    await wait_for_load(session, pd.decode.url, "num_transfer_reqs", 0)
    assert_pools_whole(pd)


async def wait_for_load(session, url, field, value, timeout=20.0):
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        async with session.get(url + "/v1/loads") as resp:
            loads = await resp.json()
        if loads["aggregate"][field] == value:
            return loads
        assert loop.time() < deadline, loads
        await asyncio.sleep(0.05)


async def test_loads_show_the_pd_queues(pd_tcp, session):
    pd = pd_tcp
    room = rooms()
    body = {"input_ids": LONG, "sampling_params": greedy(4), **pd.pd_fields(room)}
    on_prefill = asyncio.create_task(post(session, pd.prefill.url + "/generate",
                                          {**body, "rid": "p1"}))
    loads = await wait_for_load(session, pd.prefill.url, "num_bootstrap_reqs", 1)
    assert loads["aggregate"]["num_waiting_reqs"] == 1
    rank = room % 2
    assert loads["loads"][rank]["num_bootstrap_reqs"] == 1
    async with session.get(pd.prefill.url + "/metrics") as resp:
        metrics = await resp.text()
    assert f'pdserve_num_bootstrap_reqs{{dp_rank="{rank}"}} 1.0' in metrics
    on_decode = asyncio.create_task(post(session, pd.decode.url + "/generate",
                                         {**body, "rid": "d1"}))
    (ps, _), (ds, dec) = await asyncio.gather(on_prefill, on_decode)
    assert (ps, ds) == (200, 200) and len(dec["output_ids"]) == 4
    await wait_for_load(session, pd.prefill.url, "num_bootstrap_reqs", 0)
    assert_pools_whole(pd)
