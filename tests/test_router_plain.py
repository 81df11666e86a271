"""Plain mode (`--worker-urls`) against a real colocated `pdserve serve` on a tiny model:
greedy output through the router equals the direct output (generate, batch, completions, chat,
streaming), request ids reach the engine, and a refused worker is retried on another one."""

from __future__ import annotations

import pytest
from server_utils import ServerProcess, free_port, http_json
from test_router_mocks import RouterProcess, post, stream_events

GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    with ServerProcess(tiny_llama_dir, "--max-total-tokens", "2048") as srv:
        yield srv


@pytest.fixture(scope="module")
def router(server):
    # the second URL never answers: every request that lands there is retried on the server
    dead = f"http://127.0.0.1:{free_port()}"
    with RouterProcess("--worker-urls", server.url, dead, "--policy", "round_robin",
                       "--disable-health-check", "--retry-initial-backoff-ms", "1") as router:
        yield router


def both(server, router, path: str, body: dict) -> tuple[object, object]:
    direct = post(server.url + path, body)
    routed = post(router.url + path, body)
    assert direct[0] == routed[0] == 200, (direct, routed)
    return direct[2], routed[2]


def test_generate_greedy_equals_direct(server, router):
    body = {"text": "The quick brown fox", "sampling_params": GREEDY}
    for _ in range(2):  # round robin: one of the two goes via a retry off the dead worker
        direct, routed = both(server, router, "/generate", body)
        assert routed["output_ids"] == direct["output_ids"] and routed["text"] == direct["text"]


def test_batch_and_token_ids_equal_direct(server, router):
    body = {"input_ids": [[5, 6, 7, 8], [40, 41]], "sampling_params": GREEDY}
    direct, routed = both(server, router, "/generate", body)
    assert [r["output_ids"] for r in routed] == [d["output_ids"] for d in direct]


def test_completions_and_chat_equal_direct(server, router):
    body = {"model": "m", "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}
    direct, routed = both(server, router, "/v1/completions", body)
    assert routed["choices"][0]["text"] == direct["choices"][0]["text"]
    body = {"model": "m", "messages": [{"role": "user", "content": "Hello there"}],
            "max_tokens": 8, "temperature": 0}
    direct, routed = both(server, router, "/v1/chat/completions", body)
    assert routed["choices"][0]["message"] == direct["choices"][0]["message"]


def test_streaming_equals_direct(server, router):
    body = {"text": "Streaming test", "sampling_params": GREEDY, "stream": True}
    direct = [e for _, e in list(stream_events(server.url + "/generate", body))[1:]]
    routed = [e for _, e in list(stream_events(router.url + "/generate", body))[1:]]
    assert routed[-1] == direct[-1] == "[DONE]"
    assert routed[-2]["output_ids"] == direct[-2]["output_ids"]
    assert routed[-2]["text"] == direct[-2]["text"]
    # how tokens group into chunks depends on timing; each chunk is a cumulative prefix
    assert all(routed[-2]["text"].startswith(c["text"]) for c in routed[:-1])


def test_request_id_reaches_the_engine(router):
    status, headers, answer = post(router.url + "/generate",
                                   {"text": "id test", "sampling_params": GREEDY},
                                   headers={"X-Request-Id": "plain-42"})
    assert status == 200 and headers["X-Request-Id"] == "plain-42"
    assert answer["meta_info"]["id"] == "plain-42"


def test_worker_errors_pass_through_unchanged(server, router):
    body = {"text": "x", "sampling_params": {"max_new_tokens": -1}}
    direct = post(server.url + "/generate", body)
    routed = post(router.url + "/generate", body)
    assert routed[0] == direct[0] == 400 and routed[2] == direct[2]
    status, info = http_json(router.url + "/get_server_info")
    assert status == 200 and info["mode"] == "plain"
    assert any("internal_states" in w for w in info["workers_info"])
