"""OpenAI-compatible routes: `/v1/completions`, `/v1/chat/completions`, `/v1/models`.

Each HTTP request fans out into one engine request per (prompt, choice); choice index is
`prompt_index * n + choice`. With `n > 1` and a seed, choice c uses seed + c so samples differ
but stay reproducible. Streams end with `data: [DONE]`; `stream_options.include_usage` adds a
last chunk with empty choices and the usage.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import aclosing
from dataclasses import dataclass

import msgspec
from aiohttp import web

from common.engine.tokenizer import ChatTemplateError
from common.messages.scheduler_input import GenerateRequest
from common.server import sse
from common.server.context import CTX, ServerContext, abort_error, collect, stream
from common.server.errors import ApiError, decode_json
from common.server.frontend import RequestOutput
from common.server.protocol import (
    ChatBody,
    CompletionBody,
    SamplingParamsBody,
    routed_rank,
    with_bootstrap,
    openai_sampling,
    sampling_from_body,
    token_id_lists,
)

COMPLETION_DEFAULT_MAX_TOKENS = 16


def _expand(
    ctx: ServerContext,
    body: CompletionBody | ChatBody,
    prompts: list[list[int]],
    params: SamplingParamsBody,
    asked_max: int | None,
    default_max: int | None,
    max_param: str,
    logprobs: int | None,
    prompt_logprobs: bool,
) -> tuple[str, list[GenerateRequest]]:
    base = body.rid or ctx.new_rid()
    rank = routed_rank(body, ctx.args.num_dp_slots)
    reqs = []
    for p, ids in enumerate(prompts):
        max_new = ctx.limits.resolve_max_new(len(ids), asked_max, default_max, max_param)
        for c in range(params.n):
            sampling = sampling_from_body(params, max_new, ctx.limits.vocab_size, "")
            if params.n > 1 and sampling.seed is not None:
                sampling = msgspec.structs.replace(sampling, seed=sampling.seed + c)
            multi = len(prompts) > 1 or params.n > 1
            reqs.append(
                GenerateRequest(
                    rid=f"{base}-{p * params.n + c}" if multi else base,
                    input_ids=ids,
                    sampling=sampling,
                    stream=body.stream,
                    return_logprob=logprobs is not None,
                    logprob_start_len=0 if prompt_logprobs else -1,
                    top_logprobs_num=logprobs or 0,
                    routed_dp_rank=rank,
                )
            )
    return base, with_bootstrap(body, reqs, ctx.args.disaggregation_mode)


def _finish_reason(out: RequestOutput) -> str | None:
    if out.finish_reason is None:
        return None
    return out.finish_reason.type


def _usage(outs: list[RequestOutput], n: int) -> dict:
    prompt = sum(o.prompt_tokens for o in outs[::n])
    completion = sum(o.completion_tokens for o in outs)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


@dataclass(slots=True)
class Progress:
    """What one choice gained since its last chunk."""

    index: int
    out: RequestOutput
    text: str  # new text
    first_id: int  # first output id not yet reported
    first_chunk: bool


async def relay_choices(
    ctx: ServerContext,
    reqs: list[GenerateRequest],
    response: web.StreamResponse,
    chunks_for: Callable[[Progress], list[dict]],
    usage_chunk: Callable[[dict], dict] | None,
    n: int,
) -> None:
    """The streaming loop both OpenAI routes share: for every update of any choice, send the
    chunks `chunks_for` builds from its progress; an error ends the stream with an error event;
    `usage_chunk` (stream_options.include_usage) closes it with the usage of all choices."""
    sent_text = [0] * len(reqs)
    sent_ids = [0] * len(reqs)
    finals: dict[int, RequestOutput] = {}
    async with aclosing(stream(ctx, reqs)) as events:
        async for i, out in events:
            if (error := abort_error(out)) is not None:
                await sse.send_event(response, error.body())
                break
            progress = Progress(i, out, out.text[sent_text[i]:], sent_ids[i],
                                sent_ids[i] == 0 and sent_text[i] == 0)
            if progress.text or out.finished or len(out.output_ids) > sent_ids[i]:
                for payload in chunks_for(progress):
                    await sse.send_event(response, payload)
            sent_text[i], sent_ids[i] = len(out.text), len(out.output_ids)
            if out.finished:
                finals[i] = out
        else:
            if usage_chunk is not None:
                outs = [finals[i] for i in range(len(reqs))]
                await sse.send_event(response, usage_chunk(_usage(outs, n)))
    await sse.send_done(response)


def _token_str(ctx: ServerContext, token: int) -> str:
    return ctx.tokenizer.decode([token], skip_special_tokens=False)


# ---- completions ---------------------------------------------------------------------------
def _completion_prompts(ctx: ServerContext, prompt) -> list[list[int]]:
    if isinstance(prompt, str):
        return [ctx.tokenizer.encode(prompt)]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return [ctx.tokenizer.encode(p) for p in prompt]
    if isinstance(prompt, list) and prompt:
        return token_id_lists(prompt, "prompt")
    raise ApiError(
        "prompt must be a non-empty string, list of strings, or list of token ids", "prompt"
    )


def _completion_logprobs(ctx: ServerContext, out: RequestOutput, first: int, k: int,
                         echo_ids: list[int] | None, text_offset: int) -> dict:
    ids, lps, tops = [], [], []
    if echo_ids is not None:
        ids += echo_ids
        lps += list(out.input_logprobs)
        tops += [t for t in out.input_top_logprobs]
    ids += out.output_ids[first:]
    lps += out.output_logprobs[first:]
    tops += out.output_top_logprobs[first:]
    tokens = [_token_str(ctx, t) for t in ids]
    offsets, pos = [], text_offset
    for tok in tokens:
        offsets.append(pos)
        pos += len(tok)
    top_maps = [
        None if not t.token_ids else
        {_token_str(ctx, tid): lp for tid, lp in zip(t.token_ids, t.logprobs)}
        for t in tops
    ] if k else None
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": top_maps,
            "text_offset": offsets}


async def handle_completions(request: web.Request) -> web.StreamResponse:
    ctx: ServerContext = request.app[CTX]
    ctx.check_accepting()
    body = decode_json(await request.read(), CompletionBody)
    if body.suffix:
        raise ApiError("suffix is not supported", "suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise ApiError("best_of must be equal to n (or omitted)", "best_of")
    prompts = _completion_prompts(ctx, body.prompt)
    for i, ids in enumerate(prompts):
        ctx.limits.check_prompt(ids, "prompt" if len(prompts) == 1 else f"prompt[{i}]")
    params = openai_sampling(body)
    base, reqs = _expand(
        ctx, body, prompts, params, body.max_tokens, COMPLETION_DEFAULT_MAX_TOKENS,
        "max_tokens", body.logprobs, body.echo and body.logprobs is not None,
    )
    ctx.check_rids_free(reqs)
    created = int(time.time())
    cid = f"cmpl-{base}"
    echo_texts = [ctx.tokenizer.decode(r.input_ids, skip_special_tokens=False) if body.echo
                  else "" for r in reqs]

    def choice(i: int, out: RequestOutput, text: str, first: int, with_prompt: bool) -> dict:
        logprobs = None
        if body.logprobs is not None:
            echo_ids = reqs[i].input_ids if (with_prompt and body.echo) else None
            offset = 0 if with_prompt else len(echo_texts[i]) + len(out.text) - len(text)
            logprobs = _completion_logprobs(ctx, out, first, body.logprobs, echo_ids, offset)
        return {"index": i, "text": text, "logprobs": logprobs,
                "finish_reason": _finish_reason(out)}

    if not body.stream:
        outs = await collect(ctx, reqs)
        for out in outs:
            if (error := abort_error(out)) is not None:
                return error.response()
        return web.json_response({
            "id": cid, "object": "text_completion", "created": created, "model": ctx.model_name,
            "choices": [choice(i, o, echo_texts[i] + o.text, 0, True) for i, o in enumerate(outs)],
            "usage": _usage(outs, params.n),
        })

    def completion_chunk(choices: list, **extra) -> dict:
        return {"id": cid, "object": "text_completion", "created": created,
                "model": ctx.model_name, "choices": choices, **extra}

    def chunks_for(p: Progress) -> list[dict]:
        text = echo_texts[p.index] + p.text if body.echo and p.first_chunk else p.text
        return [completion_chunk([choice(p.index, p.out, text, p.first_id, p.first_chunk)])]

    include_usage = body.stream_options is not None and body.stream_options.include_usage
    response = await sse.open_stream(request)
    await relay_choices(ctx, reqs, response, chunks_for,
                        (lambda usage: completion_chunk([], usage=usage)) if include_usage
                        else None, params.n)
    return response


# ---- chat ------------------------------------------------------------------------------------
def _chat_prompt(ctx: ServerContext, body: ChatBody) -> list[int]:
    if not body.messages:
        raise ApiError("messages must not be empty", "messages")
    if body.tools:
        raise ApiError("tools are not supported by this server", "tools")
    if body.response_format and body.response_format.get("type", "text") != "text":
        raise ApiError("only response_format type 'text' is supported", "response_format")
    messages = [msgspec.to_builtins(m) for m in body.messages]
    for m in messages:
        if m.get("name") is None:
            m.pop("name", None)
    try:
        text = ctx.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except ChatTemplateError as exc:
        raise ApiError(f"cannot render the chat template: {exc}", "messages") from None
    ids = ctx.tokenizer.encode(text, add_special_tokens=False)
    ctx.limits.check_prompt(ids, "messages")
    return ids


def _chat_logprobs(ctx: ServerContext, out: RequestOutput, first: int, last: int,
                   k: int) -> dict:
    content = []
    for i in range(first, last):
        tok = _token_str(ctx, out.output_ids[i])
        top = out.output_top_logprobs[i] if k else None
        content.append({
            "token": tok, "logprob": out.output_logprobs[i], "bytes": list(tok.encode()),
            "top_logprobs": [] if top is None else [
                {"token": (s := _token_str(ctx, t)), "logprob": lp, "bytes": list(s.encode())}
                for t, lp in zip(top.token_ids, top.logprobs)
            ],
        })
    return {"content": content}


async def handle_chat(request: web.Request) -> web.StreamResponse:
    ctx: ServerContext = request.app[CTX]
    ctx.check_accepting()
    body = decode_json(await request.read(), ChatBody)
    if body.top_logprobs and not body.logprobs:
        raise ApiError("top_logprobs requires logprobs to be true", "top_logprobs")
    ids = _chat_prompt(ctx, body)
    params = openai_sampling(body)
    asked = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    base, reqs = _expand(
        ctx, body, [ids], params, asked, None, param, logprobs, False
    )
    ctx.check_rids_free(reqs)
    created = int(time.time())
    cid = f"chatcmpl-{base}"
    k = body.top_logprobs or 0

    if not body.stream:
        outs = await collect(ctx, reqs)
        for out in outs:
            if (error := abort_error(out)) is not None:
                return error.response()
        choices = [{
            "index": i,
            "message": {"role": "assistant", "content": o.text},
            "logprobs": _chat_logprobs(ctx, o, 0, len(o.output_ids), k) if body.logprobs
            else None,
            "finish_reason": _finish_reason(o),
        } for i, o in enumerate(outs)]
        return web.json_response({
            "id": cid, "object": "chat.completion", "created": created, "model": ctx.model_name,
            "choices": choices, "usage": _usage(outs, params.n),
        })

    def chunk(choices: list, **extra) -> dict:
        return {"id": cid, "object": "chat.completion.chunk", "created": created,
                "model": ctx.model_name, "choices": choices, **extra}

    response = await sse.open_stream(request)
    for i in range(len(reqs)):
        await sse.send_event(response, chunk([{"index": i, "delta": {"role": "assistant",
                                                                     "content": ""},
                                               "logprobs": None, "finish_reason": None}]))
    def chunks_for(p: Progress) -> list[dict]:
        payloads = []
        lp = (_chat_logprobs(ctx, p.out, p.first_id, len(p.out.output_ids), k)
              if body.logprobs else None)
        if p.text or (lp and lp["content"]):
            payloads.append(chunk([{"index": p.index, "delta": {"content": p.text},
                                    "logprobs": lp, "finish_reason": None}]))
        if p.out.finished:
            payloads.append(chunk([{"index": p.index, "delta": {}, "logprobs": None,
                                    "finish_reason": _finish_reason(p.out)}]))
        return payloads

    include_usage = body.stream_options is not None and body.stream_options.include_usage
    await relay_choices(ctx, reqs, response, chunks_for,
                        (lambda usage: chunk([], usage=usage)) if include_usage else None,
                        params.n)
    return response


async def handle_models(request: web.Request) -> web.Response:
    ctx: ServerContext = request.app[CTX]
    return web.json_response({"object": "list", "data": [{
        "id": ctx.model_name, "object": "model", "created": int(ctx.started),
        "owned_by": "pdserve", "root": ctx.model_path, "max_model_len": ctx.limits.context_length,
    }]})
