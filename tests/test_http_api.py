"""The HTTP API of one real `pdserve serve` process tree (tiny random Llama), end to end.

* `/generate`: text / input_ids, single / batch, per-item sampling params, `n`, `rid`, the
  response fields, SSE streaming, logprobs, determinism (greedy and seeded), stop strings,
  stop token ids, `ignore_eos`, `max_new_tokens`.
* OpenAI `/v1/completions`, `/v1/chat/completions` (streaming and not) and `/v1/models`.
* Health, server / model info, `/flush_cache`, `/abort_request`.

One server for the whole module; every request has a bounded timeout.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import time

import aiohttp
import pytest

from common.config import ServerArgs
from server_utils import ServerProcess

TIMEOUT = aiohttp.ClientTimeout(total=60)
PROMPTS = ["The quick brown fox", "Hello, world!", "Once upon a time", "SELECT id, name FROM"]
EOS = 2
CONTEXT_LENGTH = 512  # the tiny checkpoints' max_position_embeddings
MAX_TOTAL_TOKENS = 4096


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    with ServerProcess(tiny_llama_dir, "--max-total-tokens", str(MAX_TOTAL_TOKENS)) as srv:
        yield srv


@pytest.fixture
async def session():
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        yield s


# --------------------------------------------------------------------------- helpers


async def post(session: aiohttp.ClientSession, url: str, body: dict) -> tuple[int, object]:
    async with session.post(url, json=body) as resp:
        return resp.status, await resp.json(content_type=None)


def parse_sse(text: str) -> list[dict]:
    """Strict SSE: `data: <json>` blocks, the last one `data: [DONE]`, nothing after it."""
    blocks = [b for b in text.split("\n\n")]
    assert blocks[-1] == "", f"stream does not end with a blank line: {text[-200:]!r}"
    blocks = blocks[:-1]
    assert blocks and blocks[-1] == "data: [DONE]", f"no [DONE] at the end: {text[-200:]!r}"
    events = []
    for block in blocks[:-1]:
        assert block.startswith("data: "), block
        events.append(json.loads(block[len("data: "):]))
    return events


async def post_stream(session: aiohttp.ClientSession, url: str, body: dict) -> list[dict]:
    async with session.post(url, json={**body, "stream": True}) as resp:
        assert resp.status == 200, await resp.text()
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        return parse_sse(await resp.text())


async def generate(session, server, body: dict) -> dict | list:
    status, out = await post(session, server.url + "/generate", body)
    assert status == 200, out
    return out


def greedy(max_new_tokens: int = 16, **extra) -> dict:
    return {"temperature": 0, "max_new_tokens": max_new_tokens, **extra}


def check_logprob(value) -> None:
    assert isinstance(value, float) and value <= 1e-5 and math.isfinite(value), value


def first_new_window(text: str, start: int = 2) -> str | None:
    """A 2-letter ASCII substring at index >= start that does not occur earlier in `text`."""
    for i in range(start, len(text) - 1):
        piece = text[i : i + 2]
        if piece.isascii() and piece.isalpha() and text.find(piece) == i:
            return piece
    return None


# --------------------------------------------------------------------------- /generate


async def test_generate_text_response_fields(server, session):
    out = await generate(session, server, {"text": PROMPTS[0],
                                           "sampling_params": greedy(8, ignore_eos=True)})
    assert set(out) >= {"text", "output_ids", "meta_info"}
    assert isinstance(out["text"], str) and out["text"]
    assert len(out["output_ids"]) == 8
    assert all(isinstance(t, int) and 0 <= t < 384 for t in out["output_ids"])
    meta = out["meta_info"]
    assert isinstance(meta["id"], str) and meta["id"]
    assert meta["prompt_tokens"] > 0
    assert meta["completion_tokens"] == 8
    assert meta["finish_reason"] == {"type": "length", "length": 8}
    assert isinstance(meta["e2e_latency"], float) and 0 < meta["e2e_latency"] < 60


async def test_generate_input_ids_matches_text(server, session):
    by_text = await generate(session, server, {
        "text": PROMPTS[1], "sampling_params": greedy(12),
        "return_logprob": True, "logprob_start_len": 0,
    })
    prompt_ids = [entry[1] for entry in by_text["meta_info"]["input_token_logprobs"]]
    assert len(prompt_ids) == by_text["meta_info"]["prompt_tokens"]
    by_ids = await generate(session, server, {"input_ids": prompt_ids,
                                              "sampling_params": greedy(12)})
    assert by_ids["output_ids"] == by_text["output_ids"]
    assert by_ids["text"] == by_text["text"]
    assert by_ids["meta_info"]["prompt_tokens"] == len(prompt_ids)


async def test_generate_batch_matches_single_requests(server, session):
    params = greedy(10, ignore_eos=True)
    singles = [await generate(session, server, {"text": p, "sampling_params": params})
               for p in PROMPTS]
    batch = await generate(session, server, {"text": PROMPTS, "sampling_params": params})
    assert isinstance(batch, list) and len(batch) == len(PROMPTS)
    assert [b["output_ids"] for b in batch] == [s["output_ids"] for s in singles]
    assert [b["text"] for b in batch] == [s["text"] for s in singles]
    assert len({b["meta_info"]["id"] for b in batch}) == len(PROMPTS)

    # The same prompts as token ids (a list of lists) give the same batch.
    ids = []
    for p in PROMPTS[:2]:
        out = await generate(session, server, {"text": p, "sampling_params": greedy(1),
                                               "return_logprob": True, "logprob_start_len": 0})
        ids.append([e[1] for e in out["meta_info"]["input_token_logprobs"]])
    by_ids = await generate(session, server, {"input_ids": ids, "sampling_params": params})
    assert isinstance(by_ids, list)
    assert [b["output_ids"] for b in by_ids] == [s["output_ids"] for s in singles[:2]]


async def test_generate_single_item_batch_is_a_list(server, session):
    out = await generate(session, server, {"text": [PROMPTS[0]], "sampling_params": greedy(3)})
    assert isinstance(out, list) and len(out) == 1


async def test_generate_per_item_sampling_params(server, session):
    out = await generate(session, server, {
        "text": PROMPTS[:3],
        "sampling_params": [
            {"max_new_tokens": 3, "ignore_eos": True, "temperature": 0},
            {"max_new_tokens": 5, "ignore_eos": True, "temperature": 0},
            {"max_new_tokens": 1, "ignore_eos": True, "temperature": 0},
        ],
    })
    assert [o["meta_info"]["completion_tokens"] for o in out] == [3, 5, 1]
    assert [len(o["output_ids"]) for o in out] == [3, 5, 1]


async def test_generate_n_samples_and_rid(server, session):
    out = await generate(session, server, {
        "text": PROMPTS[0], "rid": "n-test",
        "sampling_params": {"n": 3, "temperature": 1.0, "seed": 7, "max_new_tokens": 16,
                            "ignore_eos": True},
    })
    assert isinstance(out, list) and len(out) == 3
    assert [o["meta_info"]["id"] for o in out] == ["n-test-0", "n-test-1", "n-test-2"]
    # Each choice uses seed + c: reproducible, and (over 16 tokens) different from each other.
    assert len({tuple(o["output_ids"]) for o in out}) == 3
    again = await generate(session, server, {
        "text": PROMPTS[0],
        "sampling_params": {"n": 3, "temperature": 1.0, "seed": 7, "max_new_tokens": 16,
                            "ignore_eos": True},
    })
    assert [o["output_ids"] for o in again] == [o["output_ids"] for o in out]

    # n with a batch: prompt-major order.
    both = await generate(session, server, {"text": PROMPTS[:2],
                                            "sampling_params": greedy(4, n=2, ignore_eos=True)})
    assert len(both) == 4
    first = await generate(session, server, {"text": PROMPTS[0], "sampling_params": greedy(4)})
    second = await generate(session, server, {"text": PROMPTS[1], "sampling_params": greedy(4)})
    assert [o["meta_info"]["prompt_tokens"] for o in both] == (
        [first["meta_info"]["prompt_tokens"]] * 2 + [second["meta_info"]["prompt_tokens"]] * 2
    )
    assert both[0]["output_ids"] == both[1]["output_ids"] == first["output_ids"]
    assert both[2]["output_ids"] == both[3]["output_ids"] == second["output_ids"]


async def test_generate_rid_is_honoured(server, session):
    out = await generate(session, server, {"text": PROMPTS[0], "rid": "my-rid-42",
                                           "sampling_params": greedy(2)})
    assert out["meta_info"]["id"] == "my-rid-42"
    batch = await generate(session, server, {"text": PROMPTS[:2], "rid": ["r-a", "r-b"],
                                             "sampling_params": greedy(2)})
    assert [o["meta_info"]["id"] for o in batch] == ["r-a", "r-b"]


async def test_generate_stream_is_cumulative_and_matches(server, session):
    body = {"text": PROMPTS[2], "sampling_params": greedy(20, ignore_eos=True)}
    full = await generate(session, server, body)
    events = await post_stream(session, server.url + "/generate", body)
    assert len(events) >= 2
    prev_text, prev_ids = "", []
    for ev in events:
        assert ev["text"].startswith(prev_text)
        assert ev["output_ids"][: len(prev_ids)] == prev_ids
        assert len(ev["output_ids"]) >= len(prev_ids)
        assert ev["meta_info"]["id"] == events[0]["meta_info"]["id"]
        prev_text, prev_ids = ev["text"], ev["output_ids"]
    assert all(ev["meta_info"]["finish_reason"] is None for ev in events[:-1])
    last = events[-1]
    assert last["meta_info"]["finish_reason"] == {"type": "length", "length": 20}
    assert last["text"] == full["text"]
    assert last["output_ids"] == full["output_ids"]
    assert last["meta_info"]["completion_tokens"] == 20


async def test_generate_stream_batch_has_indices(server, session):
    body = {"text": PROMPTS[:2], "sampling_params": greedy(6, ignore_eos=True)}
    full = await generate(session, server, body)
    events = await post_stream(session, server.url + "/generate", body)
    finals = {}
    for ev in events:
        assert ev["index"] in (0, 1)
        if ev["meta_info"]["finish_reason"] is not None:
            assert ev["index"] not in finals
            finals[ev["index"]] = ev
    assert sorted(finals) == [0, 1]
    assert [finals[i]["text"] for i in (0, 1)] == [f["text"] for f in full]


async def test_generate_logprobs(server, session):
    k = 3
    out = await generate(session, server, {
        "text": PROMPTS[0], "sampling_params": greedy(6, ignore_eos=True),
        "return_logprob": True, "top_logprobs_num": k, "logprob_start_len": 0,
    })
    meta = out["meta_info"]
    n_prompt, n_out = meta["prompt_tokens"], meta["completion_tokens"]
    inp, outp = meta["input_token_logprobs"], meta["output_token_logprobs"]
    assert len(inp) == n_prompt and len(outp) == n_out == len(out["output_ids"])
    assert inp[0][0] is None  # nothing predicts the first prompt token
    for lp, tok, text in inp[1:]:
        check_logprob(lp)
        assert isinstance(tok, int) and text is None
    assert [e[1] for e in outp] == out["output_ids"]
    for lp, _, _ in outp:
        check_logprob(lp)
    in_top, out_top = meta["input_top_logprobs"], meta["output_top_logprobs"]
    assert len(in_top) == n_prompt and len(out_top) == n_out
    assert in_top[0] is None
    for row in in_top[1:] + out_top:
        assert len(row) == k
        values = [e[0] for e in row]
        assert values == sorted(values, reverse=True)
    # Greedy: the chosen token is the most likely one, with the same logprob.
    for (lp, tok, _), row in zip(outp, out_top):
        assert row[0][1] == tok
        assert row[0][0] == pytest.approx(lp, abs=1e-5)

    # logprob_start_len=2 returns the tail of the same prompt logprobs.
    tail = await generate(session, server, {
        "text": PROMPTS[0], "sampling_params": greedy(6, ignore_eos=True),
        "return_logprob": True, "logprob_start_len": 2, "return_text_in_logprobs": True,
    })
    tmeta = tail["meta_info"]
    assert len(tmeta["input_token_logprobs"]) == n_prompt - 2
    assert [e[1] for e in tmeta["input_token_logprobs"]] == [e[1] for e in inp[2:]]
    for got, want in zip(tmeta["input_token_logprobs"], inp[2:]):
        assert got[0] == pytest.approx(want[0], abs=1e-4)
        assert isinstance(got[2], str)
    assert "input_top_logprobs" not in tmeta  # top_logprobs_num 0
    assert tail["output_ids"] == out["output_ids"]


async def test_generate_greedy_is_deterministic(server, session):
    body = {"text": PROMPTS[3], "sampling_params": greedy(24)}
    a = await generate(session, server, body)
    b = await generate(session, server, body)
    assert a["output_ids"] == b["output_ids"] and a["text"] == b["text"]


async def test_generate_seeded_sampling(server, session):
    def body(seed):
        return {"text": PROMPTS[1], "sampling_params": {
            "temperature": 1.0, "seed": seed, "max_new_tokens": 16, "ignore_eos": True}}

    a = await generate(session, server, body(1234))
    b = await generate(session, server, body(1234))
    c = await generate(session, server, body(4321))
    assert a["output_ids"] == b["output_ids"]
    assert a["output_ids"] != c["output_ids"]
    # Running alongside other requests does not change a seeded sample.
    together = await asyncio.gather(*(generate(session, server, body(s)) for s in (1234, 99)))
    assert together[0]["output_ids"] == a["output_ids"]


async def prompt_with_stop(session, server, **extra) -> tuple[str, dict, str]:
    """A prompt whose 32-token greedy output has a usable stop string, that output, the stop."""
    for prompt in PROMPTS:
        base = await generate(session, server, {"text": prompt, "sampling_params": greedy(32),
                                                **extra})
        stop = first_new_window(base["text"])
        if stop is not None:
            return prompt, base, stop
    pytest.fail("no greedy output with a usable stop string")


async def test_generate_stop_string(server, session):
    prompt, base, stop = await prompt_with_stop(session, server)
    cut = base["text"].index(stop)
    body = {"text": prompt, "sampling_params": greedy(32, stop=[stop, "never-seen-stop"])}
    out = await generate(session, server, body)
    assert out["text"] == base["text"][:cut]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["output_ids"] == base["output_ids"][: len(out["output_ids"])]
    assert len(out["output_ids"]) < 32
    # Streaming: no chunk ever shows the stop string; the last equals the non-stream text.
    events = await post_stream(session, server.url + "/generate", body)
    assert all(stop not in ev["text"] for ev in events)
    assert events[-1]["text"] == out["text"]
    # no_stop_trim keeps the stop string.
    kept = await generate(session, server, {"text": prompt, "sampling_params": greedy(
        32, stop=stop, no_stop_trim=True)})
    assert kept["text"].startswith(base["text"][:cut] + stop)
    # An empty stop string is ignored rather than matching at once.
    empty = await generate(session, server, {"text": prompt, "sampling_params": greedy(
        8, stop="", ignore_eos=True)})
    assert empty["meta_info"]["finish_reason"]["type"] == "length"


async def test_generate_stop_token_ids(server, session):
    base = await generate(session, server, {"text": PROMPTS[0],
                                            "sampling_params": greedy(24, ignore_eos=True)})
    ids = base["output_ids"]
    j = next(j for j in range(1, len(ids)) if ids[j] not in ids[:j])
    out = await generate(session, server, {"text": PROMPTS[0], "sampling_params": greedy(
        24, stop_token_ids=[ids[j]])})
    assert out["output_ids"] == ids[: j + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": ids[j]}


async def test_generate_eos_and_ignore_eos(server, session):
    force_eos = {"logit_bias": {str(EOS): 100.0}}
    out = await generate(session, server, {"text": PROMPTS[0],
                                           "sampling_params": greedy(5, **force_eos)})
    assert out["output_ids"] == [EOS]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": EOS}
    assert out["text"] == ""  # special tokens skipped
    out = await generate(session, server, {"text": PROMPTS[0], "sampling_params": greedy(
        5, ignore_eos=True, **force_eos)})
    assert out["output_ids"] == [EOS] * 5
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    out = await generate(session, server, {"text": PROMPTS[0], "sampling_params": greedy(
        5, ignore_eos=True, skip_special_tokens=False, **force_eos)})
    assert out["text"] == "<|im_end|>" * 5
    # min_new_tokens holds EOS back.
    out = await generate(session, server, {"text": PROMPTS[0], "sampling_params": greedy(
        8, min_new_tokens=3, **force_eos)})
    assert len(out["output_ids"]) == 4 and out["output_ids"][-1] == EOS
    assert EOS not in out["output_ids"][:3]


@pytest.mark.parametrize("n", [0, 1, 7, 40])
async def test_generate_max_new_tokens(server, session, n):
    out = await generate(session, server, {"text": PROMPTS[0],
                                           "sampling_params": greedy(n, ignore_eos=True)})
    assert len(out["output_ids"]) == n
    assert out["meta_info"]["completion_tokens"] == n
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": n}
    if n == 0:
        assert out["text"] == ""


async def test_generate_default_max_new_tokens_fits_context(server, session):
    # A prompt near the context limit with no max_new_tokens gets only the room left.
    ids = [65 + (i % 26) for i in range(CONTEXT_LENGTH - 4)]
    out = await generate(session, server, {"input_ids": ids,
                                           "sampling_params": {"ignore_eos": True}})
    assert out["meta_info"]["completion_tokens"] == 4
    assert out["meta_info"]["finish_reason"]["type"] == "length"


# --------------------------------------------------------------------------- /v1/completions


async def test_completions_shape_and_cross_check(server, session):
    body = {"model": "tinyllama", "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0,
            "ignore_eos": True}
    status, out = await post(session, server.url + "/v1/completions", body)
    assert status == 200, out
    assert out["id"].startswith("cmpl-")
    assert out["object"] == "text_completion"
    assert isinstance(out["created"], int) and abs(out["created"] - time.time()) < 120
    assert out["model"] == server_model_name(server)
    [choice] = out["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "length"
    assert choice["logprobs"] is None
    gen = await generate(session, server, {"text": PROMPTS[0],
                                           "sampling_params": greedy(8, ignore_eos=True)})
    assert choice["text"] == gen["text"]
    usage = out["usage"]
    assert usage["prompt_tokens"] == gen["meta_info"]["prompt_tokens"]
    assert usage["completion_tokens"] == 8
    assert usage["total_tokens"] == usage["prompt_tokens"] + 8

    # Default max_tokens is 16.
    status, out = await post(session, server.url + "/v1/completions",
                             {"prompt": PROMPTS[0], "ignore_eos": True})
    assert status == 200 and out["usage"]["completion_tokens"] == 16


def server_model_name(server) -> str:
    return server.args[server.args.index("--model-path") + 1].rstrip("/").split("/")[-1]


async def test_completions_stream(server, session):
    body = {"prompt": PROMPTS[1], "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    status, full = await post(session, server.url + "/v1/completions", body)
    assert status == 200
    events = await post_stream(session, server.url + "/v1/completions",
                               {**body, "stream_options": {"include_usage": True}})
    *chunks, usage_chunk = events
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"] == full["usage"]
    assert all(c["object"] == "text_completion" for c in events)
    assert len({c["id"] for c in events}) == 1 and events[0]["id"].startswith("cmpl-")
    assert all("usage" not in c or c["usage"] is None for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == full["choices"][0]["text"]
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    # Without include_usage, no usage chunk.
    events = await post_stream(session, server.url + "/v1/completions", body)
    assert all(c["choices"] for c in events)


async def test_completions_n_and_batch(server, session):
    body = {"prompt": PROMPTS[0], "max_tokens": 6, "temperature": 1.0, "seed": 3, "n": 3,
            "ignore_eos": True}
    status, out = await post(session, server.url + "/v1/completions", body)
    assert status == 200, out
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    assert out["usage"]["completion_tokens"] == 18
    single = await generate(session, server, {"text": PROMPTS[0], "sampling_params": greedy(1)})
    assert out["usage"]["prompt_tokens"] == single["meta_info"]["prompt_tokens"]
    events = await post_stream(session, server.url + "/v1/completions", body)
    texts: dict[int, str] = {}
    finished = set()
    for ev in events:
        for c in ev["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
            if c["finish_reason"] is not None:
                finished.add(c["index"])
    assert finished == {0, 1, 2}
    assert [texts[i] for i in range(3)] == [c["text"] for c in out["choices"]]

    # A batch of prompts: choice index = prompt index * n + choice.
    status, out = await post(session, server.url + "/v1/completions", {
        "prompt": PROMPTS[:2], "max_tokens": 4, "temperature": 0, "n": 2, "ignore_eos": True})
    assert status == 200
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    assert out["choices"][0]["text"] == out["choices"][1]["text"]
    assert out["choices"][2]["text"] == out["choices"][3]["text"]


async def test_completions_stop_seed_and_token_prompt(server, session):
    prompt, gen, stop = await prompt_with_stop(session, server, return_logprob=True,
                                               logprob_start_len=0)
    prompt_ids = [e[1] for e in gen["meta_info"]["input_token_logprobs"]]
    status, out = await post(session, server.url + "/v1/completions", {
        "prompt": prompt, "max_tokens": 32, "temperature": 0, "stop": stop})
    assert status == 200
    assert out["choices"][0]["text"] == gen["text"][: gen["text"].index(stop)]
    assert out["choices"][0]["finish_reason"] == "stop"

    # Prompt as token ids (and a batch of them).
    status, out = await post(session, server.url + "/v1/completions", {
        "prompt": prompt_ids, "max_tokens": 32, "temperature": 0})
    assert status == 200 and out["choices"][0]["text"] == gen["text"]
    status, out = await post(session, server.url + "/v1/completions", {
        "prompt": [prompt_ids, prompt_ids[:3]], "max_tokens": 5, "temperature": 0})
    assert status == 200 and len(out["choices"]) == 2
    assert out["choices"][0]["text"] == gen["text"][: len(out["choices"][0]["text"])]

    # seed
    body = {"prompt": prompt, "max_tokens": 16, "temperature": 1.0, "ignore_eos": True}
    texts = []
    for seed in (11, 11, 12):
        status, out = await post(session, server.url + "/v1/completions", {**body, "seed": seed})
        assert status == 200
        texts.append(out["choices"][0]["text"])
    assert texts[0] == texts[1] != texts[2]


async def test_completions_logprobs_and_echo(server, session):
    body = {"prompt": PROMPTS[0], "max_tokens": 5, "temperature": 0, "ignore_eos": True,
            "logprobs": 2}
    status, out = await post(session, server.url + "/v1/completions", body)
    assert status == 200, out
    choice = out["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 5
    assert len(lp["text_offset"]) == 5
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][0] == 0
    for value, top in zip(lp["token_logprobs"], lp["top_logprobs"]):
        check_logprob(value)
        assert 1 <= len(top) <= 2
        assert max(top.values()) == pytest.approx(value, abs=1e-5)  # greedy picks the top

    # echo: the prompt comes first in the text; with logprobs, the prompt's tokens too.
    status, echoed = await post(session, server.url + "/v1/completions", {**body, "echo": True})
    assert status == 200
    ec = echoed["choices"][0]
    assert ec["text"] == PROMPTS[0] + choice["text"]
    n_prompt = echoed["usage"]["prompt_tokens"]
    assert len(ec["logprobs"]["tokens"]) == n_prompt + 5
    assert ec["logprobs"]["token_logprobs"][0] is None
    assert ec["logprobs"]["token_logprobs"][n_prompt:] == pytest.approx(lp["token_logprobs"],
                                                                         abs=1e-4)
    assert "".join(ec["logprobs"]["tokens"][:n_prompt]) == PROMPTS[0]
    status, echo_only = await post(session, server.url + "/v1/completions", {
        "prompt": PROMPTS[0], "max_tokens": 3, "temperature": 0, "echo": True})
    assert status == 200 and echo_only["choices"][0]["text"].startswith(PROMPTS[0])
    # Streaming echo: the first chunk starts with the prompt.
    events = await post_stream(session, server.url + "/v1/completions",
                               {**body, "echo": True, "logprobs": None})
    assert "".join(e["choices"][0]["text"] for e in events) == ec["text"]


# --------------------------------------------------------------------------- /v1/chat/completions

CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi!"}]


async def test_chat_shape_and_template(server, session):
    body = {"model": "x", "messages": CHAT, "max_tokens": 8, "temperature": 0,
            "ignore_eos": True}
    status, out = await post(session, server.url + "/v1/chat/completions", body)
    assert status == 200, out
    assert out["id"].startswith("chatcmpl-")
    assert out["object"] == "chat.completion"
    assert isinstance(out["created"], int)
    [choice] = out["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "length"
    assert choice["message"]["role"] == "assistant"
    assert isinstance(choice["message"]["content"], str)
    assert choice["logprobs"] is None
    # The chat template (ChatML) rendered by hand gives the same prompt and output.
    rendered = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in CHAT)
    rendered += "<|im_start|>assistant\n"
    status, comp = await post(session, server.url + "/v1/completions", {
        "prompt": rendered, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
    assert status == 200
    assert comp["choices"][0]["text"] == choice["message"]["content"]
    assert comp["usage"] == out["usage"]
    assert out["usage"]["completion_tokens"] == 8
    # Text content parts are accepted and mean the same.
    parts = [{"role": "system", "content": [{"type": "text", "text": "You are terse."}]},
             {"role": "user", "content": [{"type": "text", "text": "Hi!"}]}]
    status, same = await post(session, server.url + "/v1/chat/completions",
                              {**body, "messages": parts})
    assert status == 200
    assert same["choices"][0]["message"]["content"] == choice["message"]["content"]


async def test_chat_stream(server, session):
    body = {"messages": CHAT, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    status, full = await post(session, server.url + "/v1/chat/completions", body)
    assert status == 200
    events = await post_stream(session, server.url + "/v1/chat/completions",
                               {**body, "stream_options": {"include_usage": True}})
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert len({e["id"] for e in events}) == 1
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    *chunks, usage_chunk = events
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == full["usage"]
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert content == full["choices"][0]["message"]["content"]
    reasons = [c["choices"][0]["finish_reason"] for c in chunks]
    assert reasons[-1] == "length" and all(r is None for r in reasons[:-1])


async def test_chat_n_logprobs_and_max_completion_tokens(server, session):
    body = {"messages": CHAT, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "n": 2,
            "logprobs": True, "top_logprobs": 3}
    status, out = await post(session, server.url + "/v1/chat/completions", body)
    assert status == 200, out
    assert [c["index"] for c in out["choices"]] == [0, 1]
    for choice in out["choices"]:
        content = choice["logprobs"]["content"]
        assert len(content) == 4
        for entry in content:
            check_logprob(entry["logprob"])
            assert isinstance(entry["token"], str)
            assert entry["bytes"] == list(entry["token"].encode())
            assert len(entry["top_logprobs"]) == 3
            assert entry["top_logprobs"][0]["logprob"] == pytest.approx(entry["logprob"],
                                                                        abs=1e-5)
    assert out["usage"]["completion_tokens"] == 8
    # Streaming with n=2: both indices finish.
    events = await post_stream(session, server.url + "/v1/chat/completions", body)
    finished = {c["index"] for e in events for c in e["choices"] if c["finish_reason"]}
    assert finished == {0, 1}
    for index in (0, 1):
        entries = [entry for e in events for c in e["choices"] if c["index"] == index
                   and c["logprobs"] for entry in c["logprobs"]["content"]]
        want = out["choices"][index]["logprobs"]["content"]
        assert [e["token"] for e in entries] == [e["token"] for e in want]
        # Batch composition may move a logprob in its last float32 bits.
        assert [e["logprob"] for e in entries] == pytest.approx(
            [e["logprob"] for e in want], abs=1e-4)
    # max_tokens 0 with logprobs: the role chunk, the finish chunk, nothing empty between.
    events = await post_stream(session, server.url + "/v1/chat/completions",
                               {**body, "n": 1, "max_tokens": 0})
    assert [e["choices"][0]["delta"] for e in events] == [
        {"role": "assistant", "content": ""}, {}]
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    # max_completion_tokens wins over max_tokens.
    status, out = await post(session, server.url + "/v1/chat/completions", {
        "messages": CHAT, "max_tokens": 2, "max_completion_tokens": 5, "ignore_eos": True})
    assert status == 200 and out["usage"]["completion_tokens"] == 5
    status, out = await post(session, server.url + "/v1/chat/completions", {
        "messages": CHAT, "max_tokens": 3, "ignore_eos": True})
    assert status == 200 and out["usage"]["completion_tokens"] == 3


async def test_chat_stop_and_seed(server, session):
    for prompt in PROMPTS:
        messages = [{"role": "user", "content": prompt}]
        status, full = await post(session, server.url + "/v1/chat/completions", {
            "messages": messages, "max_tokens": 32, "temperature": 0})
        assert status == 200
        text = full["choices"][0]["message"]["content"]
        stop = first_new_window(text)
        if stop is not None:
            break
    else:
        pytest.fail("no greedy chat output with a usable stop string")
    status, out = await post(session, server.url + "/v1/chat/completions", {
        "messages": messages, "max_tokens": 32, "temperature": 0, "stop": [stop]})
    assert status == 200
    assert out["choices"][0]["message"]["content"] == text[: text.index(stop)]
    assert out["choices"][0]["finish_reason"] == "stop"
    outs = []
    for seed in (5, 5, 6):
        status, out = await post(session, server.url + "/v1/chat/completions", {
            "messages": CHAT, "max_tokens": 16, "temperature": 1.0, "seed": seed,
            "ignore_eos": True})
        assert status == 200
        outs.append(out["choices"][0]["message"]["content"])
    assert outs[0] == outs[1] != outs[2]


async def test_models(server, session):
    async with session.get(server.url + "/v1/models") as resp:
        assert resp.status == 200
        out = await resp.json()
    assert out["object"] == "list"
    [model] = out["data"]
    assert model["id"] == server_model_name(server)
    assert model["object"] == "model"
    assert model["max_model_len"] == CONTEXT_LENGTH


# --------------------------------------------------------------------------- admin routes


async def test_health_routes(server, session):
    for path in ("/health", "/health_generate"):
        async with session.get(server.url + path) as resp:
            assert resp.status == 200
            assert (await resp.json())["status"] == "ok"


async def test_server_info(server, session):
    async with session.get(server.url + "/get_server_info") as resp:
        assert resp.status == 200
        info = await resp.json()
    missing = {f.name for f in dataclasses.fields(ServerArgs)} - set(info)
    assert not missing, missing
    assert info["port"] == server.port
    assert info["max_total_tokens"] == MAX_TOTAL_TOKENS
    assert info["context_length"] == CONTEXT_LENGTH  # resolved from the model
    assert info["vocab_size"] == 384
    assert info["architecture"] == "LlamaForCausalLM"
    assert info["device"] == "cpu" and info["dtype"] == "float32"
    # The flags as given, next to the resolved values above.
    assert set(info["server_args"]) == {f.name for f in dataclasses.fields(ServerArgs)}
    assert info["server_args"]["port"] == server.port
    assert info["server_args"]["context_length"] is None  # not given: resolved above
    assert info["num_pages"] * info["page_size"] == MAX_TOTAL_TOKENS
    assert info["served_model_name"] == server_model_name(server)
    [state] = info["internal_states"]
    assert state["num_total_pages"] == info["num_pages"]
    assert 0 <= state["num_free_pages"] <= state["num_total_pages"]
    assert "type" not in info


async def test_model_info(server, session):
    async with session.get(server.url + "/get_model_info") as resp:
        assert resp.status == 200
        info = await resp.json()
    assert info["architecture"] == "LlamaForCausalLM"
    assert info["context_length"] == CONTEXT_LENGTH
    assert info["vocab_size"] == 384
    assert info["has_chat_template"] is True
    assert info["is_generation"] is True


async def _first_event(resp: aiohttp.ClientResponse) -> dict:
    line = await asyncio.wait_for(resp.content.readline(), 30)
    assert line.startswith(b"data: "), line
    assert await asyncio.wait_for(resp.content.readline(), 30) == b"\n"
    return json.loads(line[len(b"data: "):])


async def test_abort_request_and_flush_cache(server, session):
    async with session.post(server.url + "/flush_cache") as resp:
        assert resp.status == 200, await resp.text()
    body = {"text": PROMPTS[0], "rid": "abort-me", "stream": True,
            "sampling_params": {"max_new_tokens": 450, "ignore_eos": True}}
    async with session.post(server.url + "/generate", json=body) as resp:
        assert resp.status == 200
        first = await _first_event(resp)
        assert first["meta_info"]["id"] == "abort-me"
        # While it runs, flushing is refused.
        async with session.post(server.url + "/flush_cache") as flush:
            assert flush.status == 409
            assert (await flush.json())["error"]["code"] == 409
        status, out = await post(session, server.url + "/abort_request", {"rid": "abort-me"})
        assert status == 200 and out["rid"] == "abort-me"
        rest = await asyncio.wait_for(resp.text(), 30)
    events = parse_sse(rest)
    assert events, rest
    last = events[-1]
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert last["meta_info"]["completion_tokens"] < 450

    # A non-streaming request aborted by rid answers 200 with finish_reason abort.
    async def abort_soon():
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            status, _ = await post(session, server.url + "/abort_request", {"rid": "abort-2"})
            if status == 200:
                return
            await asyncio.sleep(0.02)
        raise AssertionError("abort-2 never became abortable")

    (status, out), _ = await asyncio.gather(
        post(session, server.url + "/generate", {
            "text": PROMPTS[1], "rid": "abort-2",
            "sampling_params": {"max_new_tokens": 450, "ignore_eos": True}}),
        abort_soon(),
    )
    assert status == 200, out
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert out["meta_info"]["completion_tokens"] < 450

    # Unknown rid -> 404 naming rid.
    status, out = await post(session, server.url + "/abort_request", {"rid": "no-such-rid"})
    assert status == 404
    assert out["error"]["param"] == "rid" and out["error"]["code"] == 404

    stats = await asyncio.to_thread(server.wait_pool_whole)
    assert stats["num_free_pages"] == stats["num_total_pages"]
    assert stats["num_running_reqs"] == 0
    async with session.post(server.url + "/flush_cache") as resp:
        assert resp.status == 200


async def test_unknown_route_and_method_are_json_errors(server, session):
    async with session.get(server.url + "/no/such/route") as resp:
        assert resp.status == 404
        assert (await resp.json())["error"]["code"] == 404
    async with session.get(server.url + "/generate") as resp:
        assert resp.status == 405
        assert (await resp.json())["error"]["code"] == 405
