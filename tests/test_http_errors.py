"""Every bad input is a 4xx JSON error naming the offending field, never a 500 or a crash.

Shape: {"error": {"message": str, "type": str, "param": str | None, "code": <status>}}.
After all of them the server still answers a normal request exactly as before, the KV pool is
whole and the log holds no traceback. One server (context length 128) for the module.
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from pathlib import Path

import aiohttp
import pytest

from common.messages import frontend_input
from common.messages.frontend_input import TextBatch, TextDelta
from common.messages.sampling import FinishReason, SamplingParams
from common.messages.scheduler_input import GenerateRequest
from common.server.frontend import FrontEnd
from common.server.ipc import IpcPaths
from server_utils import ServerProcess

CONTEXT_LENGTH = 128
TIMEOUT = 60
GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
REFERENCE_BODY = {"text": "The quick brown fox", "sampling_params": GREEDY}
CHAT = [{"role": "user", "content": "hi"}]
LONG_TEXT = "hello world " * 100  # far more than 128 tokens

_reference: dict = {}


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    with ServerProcess(tiny_llama_dir, "--max-total-tokens", "4096",
                       "--context-length", str(CONTEXT_LENGTH)) as srv:
        status, out = post(srv.url + "/generate", REFERENCE_BODY)
        assert status == 200, out
        _reference["generate"] = out
        yield srv


def post(url: str, body: object = None, raw: bytes | None = None,
         headers: dict | None = None) -> tuple[int, object]:
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="POST",
                                 headers=headers or {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as exc:
        assert exc.headers.get("Content-Type", "").startswith("application/json"), exc.headers
        return exc.code, json.loads(exc.read())


def check_error(status: int, body: object, want_status: int, want_param: str | None) -> None:
    assert status == want_status, body
    assert isinstance(body, dict) and set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert err["code"] == want_status
    assert err["type"] == {400: "invalid_request_error", 404: "not_found_error",
                           409: "conflict_error"}[want_status]
    assert err["param"] == want_param, err


G, C, CH = "/generate", "/v1/completions", "/v1/chat/completions"


def gen(**sampling) -> dict:
    return {"text": "hi", "sampling_params": sampling}


def chat(**extra) -> dict:
    return {"messages": CHAT, **extra}


# (id, path, body (dict) or raw bytes, expected param); all expect 400.
CASES = [
    # ---- not a JSON object at all
    ("malformed-json", G, b"{bad json", None),
    ("truncated-json", C, b'{"prompt": "hi"', None),
    ("empty-body", G, b"", None),
    ("blank-body", CH, b"   \n", None),
    ("json-array", G, b"[1, 2]", None),
    ("json-string", C, b'"hello"', None),
    ("json-null", CH, b"null", None),
    ("nan-literal", G, b'{"text": "hi", "sampling_params": {"temperature": NaN}}', None),
    # ---- wrong types
    ("text-int", G, {"text": 5}, "text"),
    ("temperature-str", G, gen(temperature="hot"), "sampling_params.temperature"),
    ("max-new-tokens-float", G, gen(max_new_tokens=1.5), "sampling_params.max_new_tokens"),
    ("max-tokens-str", C, {"prompt": "hi", "max_tokens": "x"}, "max_tokens"),
    ("chat-max-tokens-str", CH, chat(max_tokens="x"), "max_tokens"),
    ("stream-str", G, {"text": "hi", "stream": "yes"}, "stream"),
    ("sampling-params-str", G, {"text": "hi", "sampling_params": "x"}, "sampling_params"),
    ("stop-int", G, gen(stop=5), "sampling_params.stop"),
    ("input-ids-str-item", G, {"input_ids": [1, "a"]}, "input_ids"),
    ("input-ids-bool-item", G, {"input_ids": [True]}, "input_ids"),
    ("input-ids-int", G, {"input_ids": 5}, "input_ids"),
    ("prompt-mixed", C, {"prompt": ["a", [2]]}, "prompt"),
    ("prompt-int", C, {"prompt": 5}, "prompt"),
    ("messages-str", CH, {"messages": "hi"}, "messages"),
    ("messages-missing", CH, {"model": "x"}, "messages"),
    ("message-no-role", CH, {"messages": [{"content": "hi"}]}, "messages[0].role"),
    ("abort-no-rid", "/abort_request", {}, "rid"),
    ("abort-rid-int", "/abort_request", {"rid": 5}, "rid"),
    # ---- out-of-range values
    ("max-new-tokens-neg", G, gen(max_new_tokens=-1), "sampling_params.max_new_tokens"),
    ("max-tokens-neg", C, {"prompt": "hi", "max_tokens": -5}, "max_tokens"),
    ("max-completion-tokens-neg", CH, chat(max_completion_tokens=-1), "max_completion_tokens"),
    ("top-p-zero", G, gen(top_p=0), "sampling_params.top_p"),
    ("top-p-big", G, gen(top_p=1.5), "sampling_params.top_p"),
    ("openai-top-p-zero", C, {"prompt": "hi", "top_p": 0}, "top_p"),
    ("temperature-neg", G, gen(temperature=-1), "sampling_params.temperature"),
    ("chat-temperature-neg", CH, chat(temperature=-1), "temperature"),
    ("top-k-neg", G, gen(top_k=-2), "sampling_params.top_k"),
    ("min-p-big", G, gen(min_p=2), "sampling_params.min_p"),
    ("repetition-penalty-zero", G, gen(repetition_penalty=0), "sampling_params.repetition_penalty"),
    ("frequency-penalty-big", C, {"prompt": "hi", "frequency_penalty": 3}, "frequency_penalty"),
    ("n-zero", G, gen(n=0), "sampling_params.n"),
    ("n-huge", G, gen(n=1000), "sampling_params.n"),
    ("openai-n-zero", C, {"prompt": "hi", "n": 0}, "n"),
    ("chat-n-huge", CH, chat(n=1000), "n"),
    ("top-logprobs-99", CH, chat(logprobs=True, top_logprobs=99), "top_logprobs"),
    ("top-logprobs-without-logprobs", CH, chat(top_logprobs=2), "top_logprobs"),
    ("completion-logprobs-99", C, {"prompt": "hi", "logprobs": 99}, "logprobs"),
    ("top-logprobs-num-99", G, {"text": "hi", "return_logprob": True, "top_logprobs_num": 99},
     "top_logprobs_num"),
    ("logprob-start-len-neg", G, {"text": "hi", "return_logprob": True,
                                  "logprob_start_len": -2}, "logprob_start_len"),
    ("logprob-start-len-past-prompt", G, {"text": "hi", "return_logprob": True,
                                          "logprob_start_len": 50}, "logprob_start_len"),
    ("seed-too-big", G, gen(seed=2**70), "sampling_params.seed"),
    # ---- limits of the model
    ("max-new-tokens-absurd", G, gen(max_new_tokens=10**9), "sampling_params.max_new_tokens"),
    ("max-new-tokens-over-context", G, gen(max_new_tokens=CONTEXT_LENGTH),
     "sampling_params.max_new_tokens"),
    ("max-tokens-absurd", C, {"prompt": "hi", "max_tokens": 10**9}, "max_tokens"),
    ("max-completion-tokens-absurd", CH, chat(max_completion_tokens=10**9),
     "max_completion_tokens"),
    ("chat-max-tokens-absurd", CH, chat(max_tokens=10**9), "max_tokens"),
    ("per-item-max-new-tokens-absurd", G,
     {"text": ["a", "b"], "sampling_params": [{}, {"max_new_tokens": 10**9}]},
     "sampling_params[1].max_new_tokens"),
    ("prompt-too-long", G, {"text": LONG_TEXT}, "text"),
    ("prompt-too-long-in-batch", G, {"text": ["hi", LONG_TEXT]}, "text[1]"),
    ("input-ids-too-long", G, {"input_ids": [65] * CONTEXT_LENGTH}, "input_ids"),
    ("completion-prompt-too-long", C, {"prompt": LONG_TEXT}, "prompt"),
    ("chat-prompt-too-long", CH, {"messages": [{"role": "user", "content": LONG_TEXT}]},
     "messages"),
    ("empty-text", G, {"text": ""}, "text"),
    ("empty-input-ids", G, {"input_ids": []}, "input_ids"),
    ("empty-text-batch", G, {"text": []}, "text"),
    ("empty-item-in-batch", G, {"text": ["hi", ""]}, "text[1]"),
    ("empty-ids-item", G, {"input_ids": [[]]}, "input_ids[0]"),
    ("empty-prompt", C, {"prompt": ""}, "prompt"),
    ("empty-prompt-list", C, {"prompt": []}, "prompt"),
    ("missing-prompt", C, {}, "prompt"),
    ("unknown-token-id", G, {"input_ids": [99999]}, "input_ids"),
    ("negative-token-id", G, {"input_ids": [-1]}, "input_ids"),
    ("padded-vocab-token-id", G, {"input_ids": [384]}, "input_ids"),
    ("unknown-token-in-batch", G, {"input_ids": [[1, 2], [3, 99999]]}, "input_ids[1]"),
    ("unknown-prompt-token", C, {"prompt": [99999]}, "prompt"),
    ("unknown-stop-token", G, gen(stop_token_ids=[99999]), "sampling_params.stop_token_ids"),
    ("openai-unknown-stop-token", C, {"prompt": "hi", "stop_token_ids": [-1]}, "stop_token_ids"),
    # ---- inconsistent requests
    ("text-and-input-ids", G, {"text": "hi", "input_ids": [1, 2]}, "text"),
    ("neither-text-nor-ids", G, {"sampling_params": {}}, "text"),
    ("unknown-sampling-param", G, gen(temprature=0.5), "sampling_params.temprature"),
    ("unknown-sampling-param-in-list", G,
     {"text": ["a", "b"], "sampling_params": [{}, {"foo": 1}]}, "sampling_params[1].foo"),
    ("sampling-params-count", G, {"text": ["a", "b"], "sampling_params": [{}]},
     "sampling_params"),
    ("rid-count", G, {"text": ["a", "b"], "rid": ["x"]}, "rid"),
    ("rid-list-for-single", G, {"text": "a", "rid": ["x", "y"]}, "rid"),
    ("rid-repeated-in-batch", G, {"text": ["a", "b"], "rid": ["same", "same"]}, "rid"),
    ("rid-string-for-batch", G, {"text": ["a", "b"], "rid": "one"}, "rid"),
    ("chat-empty-messages", CH, {"messages": []}, "messages"),
    ("chat-image-part", CH, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, "messages"),
    ("chat-tools", CH, chat(tools=[{"type": "function", "function": {"name": "f"}}]), "tools"),
    ("chat-json-mode", CH, chat(response_format={"type": "json_object"}), "response_format"),
    ("completion-suffix", C, {"prompt": "hi", "suffix": "bye"}, "suffix"),
    ("best-of-not-n", C, {"prompt": "hi", "best_of": 3, "n": 1}, "best_of"),
    ("logit-bias-bad-key", G, gen(logit_bias={"abc": 1.0}), "sampling_params.logit_bias"),
    ("logit-bias-out-of-vocab", G, gen(logit_bias={"99999": 1.0}), "sampling_params.logit_bias"),
    ("logit-bias-huge", G, gen(logit_bias={"5": 1e9}), "sampling_params.logit_bias"),
    ("openai-logit-bias-bad-key", C, {"prompt": "hi", "logit_bias": {"abc": 1}}, "logit_bias"),
    ("chat-logit-bias-bad-value", CH, chat(logit_bias={"5": "x"}), "logit_bias"),
]


@pytest.mark.parametrize(("path", "body", "param"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_bad_request_is_400_naming_the_field(server, path, body, param):
    if isinstance(body, bytes):
        status, out = post(server.url + path, raw=body)
    else:
        status, out = post(server.url + path, body)
    check_error(status, out, 400, param)


@pytest.mark.parametrize("path", [G, C, CH])
def test_wrong_content_type_still_parsed_or_rejected_cleanly(server, path):
    # Clients that forget the header still get a JSON answer (never a 500).
    status, out = post(server.url + path, raw=b"not json", headers={"Content-Type": "text/plain"})
    check_error(status, out, 400, None)


def test_unknown_rid_abort_is_404(server):
    status, out = post(server.url + "/abort_request", {"rid": "nobody"})
    check_error(status, out, 404, "rid")


async def test_duplicate_rid_in_flight_is_409(server):
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as session:
        body = {"text": "hi", "rid": "dup-rid", "stream": True,
                "sampling_params": {"max_new_tokens": 100, "ignore_eos": True}}
        async with session.post(server.url + G, json=body) as resp:
            assert resp.status == 200
            first = await asyncio.wait_for(resp.content.readline(), TIMEOUT)
            assert first.startswith(b"data: ")
            for path, dup in [
                (G, {"text": "other", "rid": "dup-rid"}),
                (G, {"text": ["a", "b"], "rid": ["x-ok", "dup-rid"]}),
                (C, {"prompt": "other", "rid": "dup-rid"}),
                (CH, chat(rid="dup-rid")),
            ]:
                status, out = await asyncio.to_thread(post, server.url + path, dup)
                check_error(status, out, 409, "rid")
            status, _ = await asyncio.to_thread(post, server.url + "/abort_request",
                                                {"rid": "dup-rid"})
            assert status == 200
            rest = await asyncio.wait_for(resp.text(), TIMEOUT)
        assert '"type":"abort"' in rest and rest.endswith("data: [DONE]\n\n")
    # The rid is free again once the first request ended.
    status, out = await asyncio.to_thread(post, server.url + G, {
        "text": "hi", "rid": "dup-rid", "sampling_params": {"max_new_tokens": 2}})
    assert status == 200 and out["meta_info"]["id"] == "dup-rid"


async def test_frontend_refuses_racing_duplicate_rid():
    """Two requests with one rid that both got past the HTTP check: the second is refused
    (409) and the first one's state is untouched, so it still gets its reply."""
    import zmq
    import zmq.asyncio

    ipc = IpcPaths.create()
    target = f"ipc://{ipc.folder}/test-scheduler"
    zctx = zmq.asyncio.Context()
    scheduler = zctx.socket(zmq.PULL)  # stands in for the scheduler
    scheduler.bind(target)
    detok = zctx.socket(zmq.PUSH)  # stands in for the detokenizer
    detok.connect(ipc.frontend_input)
    frontend = FrontEnd(ipc, target)
    frontend.start()
    try:
        req = GenerateRequest(rid="same", input_ids=[1, 2], sampling=SamplingParams())
        first = frontend.generate(req)
        first_out = asyncio.create_task(anext(first))
        for _ in range(500):
            if frontend.is_inflight("same"):
                break
            await asyncio.sleep(0.01)
        assert frontend.is_inflight("same")

        async def drain(gen):
            return [o async for o in gen]

        second = await asyncio.wait_for(drain(frontend.generate(req)), 5)
        assert len(second) == 1 and second[0].finished
        assert second[0].finish_reason.type == "abort"
        assert second[0].finish_reason.status == 409
        assert frontend.is_inflight("same")

        delta = TextDelta(rid="same", text="ok", new_ids=[7], prompt_tokens=2,
                          completion_tokens=1, finished=True,
                          finish_reason=FinishReason(type="length", length=1))
        await detok.send(frontend_input.encoder.encode(TextBatch(deltas=[delta])))
        out = await asyncio.wait_for(first_out, 5)
        assert out.finished and out.text == "ok" and out.output_ids == [7]
        await first.aclose()
        assert not frontend.is_inflight("same")
    finally:
        await frontend.close()
        zctx.destroy(linger=0)
        ipc.remove()


def test_extreme_but_valid_values_do_not_crash(server):
    """Values the schema allows but the engine cannot take as they are."""
    # top_k far beyond the vocabulary (and beyond int64) means "no top-k".
    status, out = post(server.url + G, gen(top_k=10**19, max_new_tokens=3, seed=1))
    assert status == 200, out
    assert out["meta_info"]["completion_tokens"] == 3
    # A temperature too small to divide by is greedy, not NaN sampling.
    status, tiny = post(server.url + G, {**REFERENCE_BODY, "sampling_params": {
        **GREEDY, "temperature": 1e-300}})
    assert status == 200, tiny
    assert tiny["output_ids"] == _reference["generate"]["output_ids"]
    # Huge min_new_tokens is bounded by max_new_tokens.
    status, out = post(server.url + G, gen(min_new_tokens=10**19, max_new_tokens=3))
    assert status == 200 and out["meta_info"]["completion_tokens"] == 3
    # An empty stop string does not stop generation at once.
    status, out = post(server.url + G, gen(stop="", max_new_tokens=4, ignore_eos=True))
    assert status == 200 and out["meta_info"]["finish_reason"]["type"] == "length"
    # max_tokens 0: only the prompt's logprobs.
    status, out = post(server.url + C, {"prompt": "hello", "max_tokens": 0, "echo": True,
                                        "logprobs": 1})
    assert status == 200 and out["usage"]["completion_tokens"] == 0
    assert out["choices"][0]["text"] == "hello"
    status, _ = post(server.url + "/health", raw=b"")  # POST on a GET route
    assert status == 405


def test_server_is_healthy_after_bad_requests(server):
    """Runs last: the same greedy request gives the same answer, nothing leaked or crashed."""
    status, out = post(server.url + G, REFERENCE_BODY)
    assert status == 200
    assert out["output_ids"] == _reference["generate"]["output_ids"]
    assert out["text"] == _reference["generate"]["text"]
    status, out = post(server.url + CH, chat(max_tokens=3))
    assert status == 200 and out["usage"]["completion_tokens"] <= 3
    stats = server.wait_pool_whole()
    assert stats["num_free_pages"] == stats["num_total_pages"]
    assert stats["num_running_reqs"] == 0 and stats["num_waiting_reqs"] == 0
    log = Path(server.log.name).read_text(errors="replace")
    assert "Traceback" not in log, log[-3000:]
    assert " 500 " not in log and "unhandled error" not in log, log[-3000:]
    assert server.proc.poll() is None
