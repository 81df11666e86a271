"""The official `openai` Python client against a real server: chat and completions, streamed
and not, `n`, logprobs, vendor extensions via `extra_body`, models, and errors that surface as
the client's typed exceptions."""

from __future__ import annotations

import openai
import pytest

from server_utils import ServerProcess

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    with ServerProcess(tiny_llama_dir, "--max-total-tokens", "4096",
                       "--served-model-name", "tiny-chat") as srv:
        yield srv


@pytest.fixture
async def client(server):
    async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0,
                                  timeout=60) as c:
        yield c


async def test_models(client):
    models = await client.models.list()
    assert [m.id for m in models.data] == ["tiny-chat"]


async def test_chat(client):
    resp = await client.chat.completions.create(
        model="tiny-chat", messages=MESSAGES, max_tokens=8, temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert resp.object == "chat.completion" and resp.model == "tiny-chat"
    [choice] = resp.choices
    assert choice.index == 0 and choice.finish_reason == "length"
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert resp.usage.completion_tokens == 8
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 8

    stream = await client.chat.completions.create(
        model="tiny-chat", messages=MESSAGES, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )
    content, reasons, usage = "", [], None
    async for chunk in stream:
        assert chunk.object == "chat.completion.chunk"
        if chunk.usage is not None:
            assert chunk.choices == []
            usage = chunk.usage
            continue
        content += chunk.choices[0].delta.content or ""
        reasons.append(chunk.choices[0].finish_reason)
    assert content == choice.message.content
    assert reasons[-1] == "length" and all(r is None for r in reasons[:-1])
    assert usage is not None and usage.model_dump() == resp.usage.model_dump()


async def test_completions(client):
    resp = await client.completions.create(
        model="tiny-chat", prompt="Once upon a time", max_tokens=10, temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert resp.object == "text_completion"
    [choice] = resp.choices
    assert choice.finish_reason == "length" and resp.usage.completion_tokens == 10

    stream = await client.completions.create(
        model="tiny-chat", prompt="Once upon a time", max_tokens=10, temperature=0,
        stream=True, extra_body={"ignore_eos": True},
    )
    text, last_reason = "", None
    async for chunk in stream:
        text += chunk.choices[0].text
        last_reason = chunk.choices[0].finish_reason
    assert text == choice.text and last_reason == "length"

    # Token-id prompt and logprobs through the client.
    resp = await client.completions.create(
        model="tiny-chat", prompt=[72, 101, 108], max_tokens=3, temperature=0, logprobs=2,
    )
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == resp.usage.completion_tokens
    assert all(len(top) <= 2 for top in lp.top_logprobs)


async def test_n_two(client):
    chat = await client.chat.completions.create(
        model="tiny-chat", messages=MESSAGES, max_tokens=6, n=2, temperature=1.0, seed=3,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.usage.completion_tokens == 12
    comp = await client.completions.create(
        model="tiny-chat", prompt="Hello", max_tokens=6, n=2, temperature=1.0, seed=3,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in comp.choices] == [0, 1]
    # Seeded: the same request again gives the same two samples.
    again = await client.completions.create(
        model="tiny-chat", prompt="Hello", max_tokens=6, n=2, temperature=1.0, seed=3,
        extra_body={"ignore_eos": True},
    )
    assert [c.text for c in again.choices] == [c.text for c in comp.choices]

    stream = await client.chat.completions.create(
        model="tiny-chat", messages=MESSAGES, max_tokens=4, n=2, temperature=0, stream=True,
    )
    finished = set()
    async for chunk in stream:
        for c in chunk.choices:
            if c.finish_reason is not None:
                finished.add(c.index)
    assert finished == {0, 1}


async def test_chat_logprobs(client):
    resp = await client.chat.completions.create(
        model="tiny-chat", messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True,
        top_logprobs=2, extra_body={"ignore_eos": True},
    )
    content = resp.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-5)


@pytest.mark.parametrize(("kind", "kwargs", "param"), [
    ("completions", {"prompt": "hi", "max_tokens": -5}, "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": 10**9}, "max_tokens"),
    ("completions", {"prompt": "hi", "suffix": "x"}, "suffix"),
    ("chat", {"messages": [], "max_tokens": 2}, "messages"),
    ("chat", {"messages": MESSAGES, "temperature": -1}, "temperature"),
    ("chat", {"messages": MESSAGES, "extra_body": {"top_k": -7}}, "top_k"),
])
async def test_bad_request_raises(client, kind, kwargs, param):
    api = client.completions if kind == "completions" else client.chat.completions
    with pytest.raises(openai.BadRequestError) as info:
        await api.create(model="tiny-chat", **kwargs)
    assert info.value.status_code == 400
    assert info.value.param == param
    assert info.value.type == "invalid_request_error"
    assert info.value.message


async def test_stream_error_raises_before_streaming(client):
    with pytest.raises(openai.BadRequestError):
        await client.chat.completions.create(
            model="tiny-chat", messages=MESSAGES, max_tokens=-1, stream=True)
