"""The whole PD stack end to end: our router in front of real `pdserve prefill` (dp 2) and
`pdserve decode` (dp 2) services on a tiny model. Greedy answers through the router equal a
colocated service's, on every route, streaming or not."""

from __future__ import annotations

import aiohttp
import pytest

from test_pd_service import post_stream
from test_router_mocks import RouterProcess


@pytest.fixture(scope="module")
def stack(pd_tcp):
    with RouterProcess("--pd-disaggregation", "--prefill", pd_tcp.prefill.url,
                       str(pd_tcp.bootstrap_port), "--decode", pd_tcp.decode.url,
                       "--policy", "round_robin") as router:
        yield pd_tcp, router


@pytest.fixture(scope="module")
def dp_aware_stack(pd_tcp):
    with RouterProcess("--pd-disaggregation", "--prefill", pd_tcp.prefill.url,
                       str(pd_tcp.bootstrap_port), "--decode", pd_tcp.decode.url,
                       "--policy", "power_of_two", "--dp-aware") as router:
        yield pd_tcp, router


@pytest.fixture
async def session():
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
        yield s


async def post(session, url, body, headers=None):
    async with session.post(url, json=body, headers=headers) as resp:
        return resp.status, await resp.json(), resp.headers


def greedy(n):
    return {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}


PROMPTS = [[5, 6, 7, 8, 9], list(range(10, 50))]


async def test_generate_single_batch_and_stream(stack, session):
    pd, router = stack
    for prompt in PROMPTS:
        body = {"input_ids": prompt, "sampling_params": greedy(10)}
        _, want, _ = await post(session, pd.colocated.url + "/generate", body)
        status, got, _ = await post(session, router.url + "/generate", body)
        assert status == 200, got
        assert got["output_ids"] == want["output_ids"]
    body = {"input_ids": PROMPTS, "sampling_params": greedy(6)}
    _, want, _ = await post(session, pd.colocated.url + "/generate", body)
    status, got, _ = await post(session, router.url + "/generate", body)
    assert status == 200, got
    assert [g["output_ids"] for g in got] == [w["output_ids"] for w in want]
    events = await post_stream(session, router.url + "/generate",
                               {"input_ids": PROMPTS[1], "sampling_params": greedy(8),
                                "stream": True})
    assert len(events) >= 2
    _, want, _ = await post(session, pd.colocated.url + "/generate",
                            {"input_ids": PROMPTS[1], "sampling_params": greedy(8)})
    assert events[-1]["output_ids"] == want["output_ids"]


async def test_openai_routes_with_n_samples_and_chat(stack, session):
    pd, router = stack
    body = {"prompt": PROMPTS, "max_tokens": 5, "temperature": 0, "ignore_eos": True, "n": 2}
    _, want, _ = await post(session, pd.colocated.url + "/v1/completions", body)
    status, got, _ = await post(session, router.url + "/v1/completions", body)
    assert status == 200, got
    assert [c["text"] for c in got["choices"]] == [c["text"] for c in want["choices"]]
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "temperature": 0}
    _, want, _ = await post(session, pd.colocated.url + "/v1/chat/completions", chat)
    status, got, _ = await post(session, router.url + "/v1/chat/completions", chat)
    assert status == 200, got
    assert got["choices"][0]["message"] == want["choices"][0]["message"]
    events = await post_stream(session, router.url + "/v1/chat/completions",
                               {**chat, "stream": True})
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events
                   if e.get("choices"))
    assert text == want["choices"][0]["message"]["content"]


async def test_request_ids_pass_through_and_logprobs(stack, session):
    pd, router = stack
    body = {"input_ids": PROMPTS[1], "sampling_params": greedy(4), "return_logprob": True,
            "logprob_start_len": 0, "unknown_extension": {"kept": True}}
    status, got, headers = await post(session, router.url + "/generate", body,
                                      headers={"X-Request-Id": "trace-42"})
    assert status == 200, got
    assert headers["X-Request-Id"] == "trace-42"
    assert got["meta_info"]["id"] == "trace-42"
    assert headers["X-PD-Prefill"] == pd.prefill.url
    assert 0 <= int(headers["X-PD-Bootstrap-Room"]) < 2**63
    # prompt logprobs come from prefill, output logprobs from decode
    assert len(got["meta_info"]["input_token_logprobs"]) == len(PROMPTS[1])
    assert len(got["meta_info"]["output_token_logprobs"]) == 4


async def test_dp_aware_routing_answers_the_same(dp_aware_stack, session):
    pd, router = dp_aware_stack
    body = {"input_ids": PROMPTS[0], "sampling_params": greedy(6)}
    _, want, _ = await post(session, pd.colocated.url + "/generate", body)
    for _ in range(4):
        status, got, _ = await post(session, router.url + "/generate", body)
        assert status == 200, got
        assert got["output_ids"] == want["output_ids"]
    for server in (pd.prefill, pd.decode):
        stats = server.wait_pool_whole()
        assert stats["num_free_pages"] == stats["num_total_pages"]
