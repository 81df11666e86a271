"""The real router process in PD mode against mock prefill/decode workers: dispatch, bootstrap
injection, pass-through, request ids, streaming order, logprob merging, admin, loads, metrics,
auth, `--dp-aware`. Faults (down, hanging, 500, mid-stream failure) are in
test_router_faults.py."""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request

import pytest
from server_utils import http_json
from test_router_mocks import (
    FAST_HEALTH,
    MockFleet,
    RouterProcess,
    post,
    stream_events,
    wait_until,
)

ROOM_LIMIT = 2**63


@pytest.fixture
def fleet():
    fleet = MockFleet()
    yield fleet
    fleet.close()


def pd_args(prefills, decodes, *extra: str) -> list[str]:
    args = ["--pd-disaggregation", *FAST_HEALTH]
    for p in prefills:
        args += ["--prefill", p.url] + ([str(p.bootstrap_port)] if hasattr(p, "bootstrap_port")
                                        else [])
    for d in decodes:
        args += ["--decode", d.url]
    return args + list(extra)


def test_non_streaming_pd_injects_bootstrap_and_passes_everything_through(fleet):
    prefill, decode = fleet.add("prefill"), fleet.add("decode")
    prefill.bootstrap_port = 9123
    body = {"text": "What is the capital of France?",
            "sampling_params": {"max_new_tokens": 8, "temperature": 0, "custom_knob": 3},
            "lora_path": None, "my_extension": {"nested": [1, "two", {"three": 3.0}]}}
    with RouterProcess(*pd_args([prefill], [decode])) as router:
        status, headers, answer = post(router.url + "/generate", body)
    assert status == 200, answer
    assert answer["meta_info"]["role"] == "decode"  # the decode side's answer
    [(p_path, p_body)] = prefill.calls
    [(d_path, d_body)] = decode.calls
    assert p_path == d_path == "/generate"
    assert p_body == d_body  # the same request on both legs
    for key, value in body.items():
        assert p_body[key] == value  # unknown fields unchanged, nothing renamed or dropped
    assert p_body["bootstrap_host"] == "127.0.0.1" and p_body["bootstrap_port"] == 9123
    assert isinstance(p_body["bootstrap_room"], int) and 0 <= p_body["bootstrap_room"] < ROOM_LIMIT
    assert p_body["rid"] == headers["X-Request-Id"] and len(p_body["rid"]) == 32


def test_default_bootstrap_port_and_fresh_rooms(fleet):
    prefill, decode = fleet.add("prefill"), fleet.add("decode")
    with RouterProcess(*pd_args([prefill], [decode])) as router:
        for _ in range(5):
            assert post(router.url + "/generate", {"text": "hi"})[0] == 200
    rooms = [b["bootstrap_room"] for b in prefill.inference_calls()]
    assert len(set(rooms)) == 5
    assert {b["bootstrap_port"] for b in prefill.inference_calls()} == {8998}


def test_request_ids_and_rooms_per_item_and_sample(fleet):
    prefill, decode = fleet.add("prefill"), fleet.add("decode")
    with RouterProcess(*pd_args([prefill], [decode])) as router:
        status, headers, _ = post(router.url + "/generate", {"text": "a"},
                                  headers={"X-Request-Id": "client-id-1"})
        assert status == 200 and headers["X-Request-Id"] == "client-id-1"
        assert decode.calls[-1][1]["rid"] == "client-id-1"
        # a body rid is kept, and becomes the request id when no header is given
        status, headers, _ = post(router.url + "/generate", {"text": "a", "rid": "body-rid"})
        assert headers["X-Request-Id"] == "body-rid" and decode.calls[-1][1]["rid"] == "body-rid"
        # batch x n: one room per (prompt, sample), one rid per prompt
        status, headers, answer = post(
            router.url + "/generate", {"text": ["a", "b", "c"], "sampling_params": {"n": 2}},
            headers={"X-Request-Id": "batch-7"})
        assert status == 200 and len(answer) == 6
        sent = decode.calls[-1][1]
        assert sent["rid"] == ["batch-7-0", "batch-7-1", "batch-7-2"]
        assert len(sent["bootstrap_room"]) == 6 and len(set(sent["bootstrap_room"])) == 6
        assert prefill.calls[-1][1]["bootstrap_room"] == sent["bootstrap_room"]
        # OpenAI routes: rooms per prompt x n, the id as rid (workers derive <id>-<i>)
        status, headers, _ = post(router.url + "/v1/completions",
                                  {"model": "m", "prompt": ["x", "y"], "n": 2, "max_tokens": 4},
                                  headers={"X-Request-Id": "cmpl-9"})
        sent = decode.calls[-1]
        assert status == 200 and sent[0] == "/v1/completions"
        assert sent[1]["rid"] == "cmpl-9" and len(sent[1]["bootstrap_room"]) == 4
        status, _, _ = post(router.url + "/v1/chat/completions",
                            {"model": "m", "messages": [{"role": "user", "content": "hey"}],
                             "max_tokens": 4, "stream_options": {"include_usage": True}})
        sent = prefill.calls[-1]
        assert status == 200 and sent[0] == "/v1/chat/completions"
        assert isinstance(sent[1]["bootstrap_room"], int)
        assert sent[1]["stream_options"] == {"include_usage": True}


def test_streaming_forwards_decode_bytes_before_the_prefill_answers(fleet):
    prefill, decode = fleet.add("prefill"), fleet.add("decode")
    prefill.delay_s = 2.0  # the prefill's reply comes late; decode's stream is ready at once
    decode.chunks = 4
    with RouterProcess(*pd_args([prefill], [decode])) as router:
        events = list(stream_events(router.url + "/generate", {"text": "hi", "stream": True}))
    assert events[0][1] == 200
    timed = events[1:]
    assert [e for _, e in timed][-1] == "[DONE]"
    chunks = [e for _, e in timed if isinstance(e, dict)]
    assert [c["text"] for c in chunks] == ["decode:x", "decode:xx", "decode:xxx", "decode:xxxx"]
    # the whole decode stream reached the client long before the prefill replied
    assert timed[0][0] < 1.0 and timed[-1][0] < 1.5, timed


def test_streaming_merges_prompt_logprobs_from_prefill(fleet):
    prefill, decode = fleet.add("prefill"), fleet.add("decode")
    prefill.delay_s = 0.3  # arrives after decode's first chunks: the final chunk waits for it
    decode.chunks = 3
    with RouterProcess(*pd_args([prefill], [decode])) as router:
        events = list(stream_events(router.url + "/generate",
                                    {"text": "hi", "stream": True, "return_logprob": True,
                                     "logprob_start_len": 0}))
        status, _, answer = post(router.url + "/generate",
                                 {"text": "hi", "return_logprob": True, "logprob_start_len": 0})
    chunks = [e for _, e in events[1:] if isinstance(e, dict)]
    final = chunks[-1]["meta_info"]
    assert final["finish_reason"] is not None
    assert final["input_token_logprobs"] == [[-1.5, 11, None], [-2.5, 12, None]]
    assert status == 200
    assert answer["meta_info"]["input_token_logprobs"] == [[-1.5, 11, None], [-2.5, 12, None]]
    assert answer["meta_info"]["output_token_logprobs"] == [[-0.5, 7, None]] * 3


def test_batch_streaming_keeps_indices(fleet):
    prefill, decode = fleet.add("prefill"), fleet.add("decode")
    with RouterProcess(*pd_args([prefill], [decode])) as router:
        events = list(stream_events(router.url + "/generate",
                                    {"text": ["a", "b"], "stream": True}))
    chunks = [e for _, e in events[1:] if isinstance(e, dict)]
    assert sorted({c["index"] for c in chunks}) == [0, 1]
    assert events[-1][1] == "[DONE]"


def test_round_robin_spreads_over_prefills_and_decodes(fleet):
    prefills = [fleet.add("prefill") for _ in range(2)]
    decodes = [fleet.add("decode") for _ in range(2)]
    for i, p in enumerate(prefills):
        p.bootstrap_port = 9000 + i
    with RouterProcess(*pd_args(prefills, decodes, "--policy", "round_robin")) as router:
        for _ in range(4):
            assert post(router.url + "/generate", {"text": "hi"})[0] == 200
    assert [len(w.calls) for w in prefills + decodes] == [2, 2, 2, 2]
    for i, p in enumerate(prefills):  # each prefill is named with its own bootstrap port
        assert {b["bootstrap_port"] for b in p.inference_calls()} == {9000 + i}
    # a decode leg always carries the bootstrap address of the prefill chosen with it
    rooms = {b["bootstrap_room"]: b["bootstrap_port"] for p in prefills
             for b in p.inference_calls()}
    for d in decodes:
        for b in d.inference_calls():
            assert rooms[b["bootstrap_room"]] == b["bootstrap_port"]


def test_cache_aware_keeps_a_prefix_on_one_prefill(fleet):
    prefills = [fleet.add("prefill") for _ in range(3)]
    decode = fleet.add("decode")
    system = "You are a very careful assistant who answers briefly. " * 3
    with RouterProcess(*pd_args(prefills, [decode], "--prefill-policy", "cache_aware",
                                "--decode-policy", "round_robin")) as router:
        for question in ("2+2?", "capital of Peru?", "a color?", "a number?"):
            assert post(router.url + "/generate", {"text": system + question})[0] == 200
    assert sorted(len(p.calls) for p in prefills) == [0, 0, 4]


def test_dp_aware_rooms_follow_the_lightest_prefill_rank(fleet):
    prefill, decode = fleet.add("prefill"), fleet.add("decode")

    def rank(r, running):
        return {"dp_rank": r, "state": "active", "timestamp": time.time() + 3600,
                "num_running_reqs": running, "num_waiting_reqs": 0, "num_total_tokens": 0,
                "stale": False}

    prefill.loads = [rank(0, 20), rank(1, 0), rank(2, 20)]
    decode.loads = [rank(0, 0), rank(1, 9)]
    with RouterProcess(*pd_args([prefill], [decode], "--dp-aware",
                                "--load-poll-interval-secs", "0.05")) as router:
        wait_until(lambda: router.workers()[prefill.url]["num_dp_slots"] == 3
                   and router.workers()[decode.url]["num_dp_slots"] == 2, 10, "loads polled")
        assert post(router.url + "/generate", {"text": ["a", "b", "c", "d"]})[0] == 200
    p_body, d_body = prefill.calls[-1][1], decode.calls[-1][1]
    assert [room % 3 for room in p_body["bootstrap_room"]] == [1, 1, 1, 1]
    assert "routed_dp_rank" not in p_body  # prefill is pinned by its room
    assert d_body["routed_dp_rank"] == 0
    assert d_body["bootstrap_room"] == p_body["bootstrap_room"]


def test_info_routes_loads_metrics_models(fleet):
    prefill, decode = fleet.add("prefill"), fleet.add("decode")
    prefill.num_dp_slots = 2
    with RouterProcess(*pd_args([prefill], [decode])) as router:
        assert post(router.url + "/generate", {"text": "hi"})[0] == 200
        status, loads = http_json(router.url + "/v1/loads")
        assert status == 200
        by_url = {w["url"]: w for w in loads["workers"]}
        assert len(by_url[prefill.url]["loads"]) == 2 and by_url[prefill.url]["role"] == "prefill"
        assert set(loads["aggregate"]) == {"prefill", "decode"}
        assert "num_running_reqs" in loads["aggregate"]["decode"]
        status, info = http_json(router.url + "/get_server_info")
        assert status == 200 and info["mode"] == "pd"
        assert info["prefill"][0]["role"] == "prefill" and info["decode"][0]["role"] == "decode"
        status, models = http_json(router.url + "/v1/models")
        assert status == 200 and models["data"][0]["id"] == "mock-decode"
        status, ready = http_json(router.url + "/readiness")
        assert status == 200 and ready["workers"]["decode"]["available"] == 1
        assert http_json(router.url + "/liveness")[0] == 200
        with urllib.request.urlopen(router.url + "/metrics", timeout=5) as resp:
            text = resp.read().decode()
        assert 'pdserve_router_http_requests_total{route="/generate",status="200"} 1.0' in text
        assert f'pdserve_router_worker_healthy{{role="prefill",worker="{prefill.url}"}} 1.0' in text


def test_malformed_bodies_are_json_errors(fleet):
    prefill, decode = fleet.add("prefill"), fleet.add("decode")
    with RouterProcess(*pd_args([prefill], [decode])) as router:
        for body in (b"", b"{not json", b"[1, 2]"):
            conn = http.client.HTTPConnection(router.url.removeprefix("http://"), timeout=5)
            conn.request("POST", "/generate", body=body,
                         headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            error = json.loads(resp.read())["error"]
            conn.close()
            assert resp.status == 400 and error["type"] == "invalid_request_error"
            assert error["code"] == 400 and "param" in error and error["message"]
    assert not prefill.calls and not decode.calls


def test_auth_guards_admin_and_inference_but_not_probes(fleet):
    prefill, decode = fleet.add("prefill"), fleet.add("decode")
    key = {"Authorization": "Bearer s3cret"}
    with RouterProcess(*pd_args([prefill], [decode], "--api-key", "s3cret")) as router:
        status, _, body = post(router.url + "/generate", {"text": "hi"})
        assert status == 401 and body["error"]["type"] == "authentication_error"
        status, _, _ = post(router.url + "/generate", {"text": "hi"},
                            headers={"Authorization": "Bearer wrong"})
        assert status == 401
        assert post(router.url + "/generate", {"text": "hi"}, headers=key)[0] == 200
        assert http_json(router.url + "/workers")[0] == 401
        assert http_json(router.url + "/v1/loads")[0] == 401
        for probe in ("/health", "/liveness", "/readiness"):
            assert http_json(router.url + probe)[0] == 200
        status, _, _ = post(router.url + "/workers", {"url": "http://127.0.0.1:1",
                                                      "role": "decode"})
        assert status == 401
    assert len(decode.calls) == 1  # only the authorised request reached a worker


def test_admin_without_api_key_is_refused(fleet):
    prefill, decode = fleet.add("prefill"), fleet.add("decode")
    with RouterProcess(*pd_args([prefill], [decode])) as router:
        status, _, body = post(router.url + "/workers", {"url": "http://127.0.0.1:1",
                                                         "role": "decode"})
        assert status == 403 and "--api-key" in body["error"]["message"]
        assert http_json(router.url + "/workers")[0] == 200  # listing stays readable


def test_workers_add_and_remove_at_run_time(fleet):
    prefill, decode = fleet.add("prefill"), fleet.add("decode")
    extra = fleet.add("decode")
    key = {"Authorization": "Bearer k"}
    with RouterProcess(*pd_args([prefill], [decode], "--decode-policy", "round_robin",
                                "--api-key", "k")) as router:
        status, _, added = post(router.url + "/workers", {"url": extra.url, "role": "decode"},
                                headers=key)
        assert status == 201 and added["role"] == "decode"
        wait_until(lambda: router_workers(router, key)[extra.url]["available"], 10,
                   "the new decode admitted")
        assert post(router.url + "/workers", {"url": extra.url, "role": "decode"},
                    headers=key)[0] == 409
        assert post(router.url + "/workers", {"url": "http://127.0.0.1:2", "role": "regular"},
                    headers=key)[0] == 400
        for _ in range(4):
            assert post(router.url + "/generate", {"text": "hi"}, headers=key)[0] == 200
        assert len(decode.calls) == 2 and len(extra.calls) == 2
        status = delete(router.url + "/workers?url=" + extra.url, key)
        assert status == 200
        assert delete(router.url + "/workers?url=" + extra.url, key) == 404
        for _ in range(2):
            assert post(router.url + "/generate", {"text": "hi"}, headers=key)[0] == 200
        assert len(decode.calls) == 4 and len(extra.calls) == 2


def router_workers(router: RouterProcess, headers: dict) -> dict:
    req = urllib.request.Request(router.url + "/workers", headers=headers)
    with urllib.request.urlopen(req, timeout=5) as resp:
        return {w["url"]: w for w in json.loads(resp.read())["workers"]}


def delete(url: str, headers: dict) -> int:
    req = urllib.request.Request(url, method="DELETE", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
