"""A client that goes away mid-generation frees its request in the scheduler at once, and
concurrent traffic is unaffected.

The disconnecting requests ask for thousands of tokens (context length 4096), far more than
can finish in the time we give the scheduler to drop them, so "no running request and a whole
KV pool" within that time can only come from the abort.
"""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest

from server_utils import ServerProcess

CONTEXT_LENGTH = 4096
LONG = 3500  # tokens the disconnecting clients ask for
ABORT_DEADLINE = 10.0  # seconds for the scheduler to drop a disconnected request
TIMEOUT = aiohttp.ClientTimeout(total=120)
PROMPTS = ["The quick brown fox", "Hello, world!", "Once upon a time", "SELECT id, name FROM"]


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    with ServerProcess(tiny_llama_dir, "--context-length", str(CONTEXT_LENGTH),
                       "--max-total-tokens", "16384") as srv:
        yield srv


@pytest.fixture
async def session():
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        yield s


async def stats(session, server) -> dict:
    async with session.get(server.url + "/get_server_info") as resp:
        assert resp.status == 200
        return (await resp.json())["internal_states"][0]


async def wait_for_stats(session, server, pred, timeout: float, what: str) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        st = await stats(session, server)
        if pred(st):
            return st
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout}s: {st}")
        await asyncio.sleep(0.05)


def idle_and_whole(st: dict) -> bool:
    return (st["num_running_reqs"] == 0 and st["num_waiting_reqs"] == 0
            and st["num_free_pages"] == st["num_total_pages"])


async def generate(session, server, body) -> dict:
    async with session.post(server.url + "/generate", json=body) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


def greedy(prompt: str, n: int) -> dict:
    return {"text": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": n,
                                                "ignore_eos": True}}


def long_body(prompt: str, **extra) -> dict:
    return {"text": prompt, "sampling_params": {"max_new_tokens": LONG, "ignore_eos": True},
            **extra}


async def test_non_streaming_disconnect_aborts(server, session):
    await wait_for_stats(session, server, idle_and_whole, 30, "idle before the test")
    reference = await generate(session, server, greedy(PROMPTS[1], 48))

    leaver = aiohttp.ClientSession(timeout=TIMEOUT)
    try:
        doomed = asyncio.create_task(leaver.post(server.url + "/generate",
                                                 json=long_body(PROMPTS[0])))
        await wait_for_stats(session, server, lambda st: st["num_running_reqs"] >= 1, 30,
                             "the long request running")
        normal = asyncio.create_task(generate(session, server, greedy(PROMPTS[1], 48)))
        await wait_for_stats(session, server, lambda st: st["num_running_reqs"] >= 2, 30,
                             "both requests running")
        doomed.cancel()  # the client gives up: its connection is closed
        with pytest.raises(asyncio.CancelledError):
            await doomed
    finally:
        await leaver.close()
    gone_at = time.monotonic()
    out = await asyncio.wait_for(normal, 60)
    assert out["output_ids"] == reference["output_ids"]
    assert out["text"] == reference["text"]
    await wait_for_stats(session, server, idle_and_whole, ABORT_DEADLINE, "idle, pool whole")
    assert time.monotonic() - gone_at < ABORT_DEADLINE


@pytest.mark.parametrize(("path", "body"), [
    ("/generate", long_body(PROMPTS[2], stream=True)),
    ("/generate", {"text": PROMPTS[:2], "stream": True,
                   "sampling_params": {"max_new_tokens": LONG, "ignore_eos": True, "n": 2}}),
    ("/v1/completions", {"prompt": PROMPTS[3], "max_tokens": LONG, "ignore_eos": True,
                         "stream": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 2,
                              "max_tokens": LONG, "ignore_eos": True, "stream": True}),
], ids=["generate", "generate-batch-n2", "completions", "chat-n2"])
async def test_streaming_disconnect_after_first_chunk_aborts(server, session, path, body):
    await wait_for_stats(session, server, idle_and_whole, 30, "idle before the test")
    reference = await generate(session, server, greedy(PROMPTS[0], 40))
    async with aiohttp.ClientSession(timeout=TIMEOUT) as leaver:
        resp = await leaver.post(server.url + path, json=body)
        assert resp.status == 200
        line = await asyncio.wait_for(resp.content.readline(), 60)
        assert line.startswith(b"data: ") and json.loads(line[6:])
        normal = asyncio.create_task(generate(session, server, greedy(PROMPTS[0], 40)))
        await wait_for_stats(session, server, lambda st: st["num_running_reqs"] >= 2, 30,
                             "the stream and the normal request running")
        resp.close()  # drop the connection mid-stream
    gone_at = time.monotonic()
    out = await asyncio.wait_for(normal, 60)
    assert out["output_ids"] == reference["output_ids"]
    await wait_for_stats(session, server, idle_and_whole, ABORT_DEADLINE, "idle, pool whole")
    assert time.monotonic() - gone_at < ABORT_DEADLINE


async def test_twenty_concurrent_requests(server, session):
    await wait_for_stats(session, server, idle_and_whole, 30, "idle before the test")
    longest = 40
    refs = {p: await generate(session, server, greedy(p, longest)) for p in PROMPTS}

    async def one(i: int) -> None:
        prompt = PROMPTS[i % len(PROMPTS)]
        n = 1 + (i * 7) % longest
        want = refs[prompt]["output_ids"][:n]
        kind = i % 4
        if kind == 0:
            out = await generate(session, server, greedy(prompt, n))
            assert out["output_ids"] == want
            assert out["meta_info"]["finish_reason"] == {"type": "length", "length": n}
        elif kind == 1:
            async with session.post(server.url + "/generate",
                                    json={**greedy(prompt, n), "stream": True}) as resp:
                assert resp.status == 200
                text = await resp.text()
            blocks = [b for b in text.split("\n\n") if b]
            assert blocks[-1] == "data: [DONE]"
            last = json.loads(blocks[-2][len("data: "):])
            assert last["output_ids"] == want
        elif kind == 2:
            async with session.post(server.url + "/v1/completions", json={
                    "prompt": prompt, "max_tokens": n, "temperature": 0,
                    "ignore_eos": True}) as resp:
                assert resp.status == 200
                out = await resp.json()
            assert out["usage"]["completion_tokens"] == n
            assert out["choices"][0]["finish_reason"] == "length"
        else:
            out = await generate(session, server, {
                "input_ids": [65 + (i % 26)] * (5 + 20 * i),
                "sampling_params": {"max_new_tokens": n, "ignore_eos": True, "seed": i}})
            assert len(out["output_ids"]) == n
            assert out["meta_info"]["prompt_tokens"] == 5 + 20 * i

    results = await asyncio.wait_for(
        asyncio.gather(*(one(i) for i in range(20)), return_exceptions=True), 120)
    failures = [r for r in results if isinstance(r, BaseException)]
    assert not failures, failures
    await wait_for_stats(session, server, idle_and_whole, ABORT_DEADLINE, "idle, pool whole")
