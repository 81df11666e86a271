"""SGLang-style `POST /generate`: text or input_ids, single or batch, streaming or not."""

from __future__ import annotations

from contextlib import aclosing

import msgspec
from aiohttp import web

from common.messages.scheduler_input import GenerateRequest
from common.server import sse
from common.server.context import CTX, ServerContext, abort_error, collect, stream
from common.server.errors import ApiError, decode_json
from common.server.frontend import RequestOutput
from common.server.protocol import (
    GenerateBody,
    routed_rank,
    sampling_body,
    sampling_from_body,
    token_id_lists,
    with_bootstrap,
)

DEFAULT_MAX_NEW_TOKENS = 128


def build_requests(ctx: ServerContext, body: GenerateBody) -> tuple[list[GenerateRequest], bool]:
    """Returns the engine requests (prompt-major, then `n` samples) and whether it is a batch."""
    if (body.text is None) == (body.input_ids is None):
        raise ApiError("exactly one of 'text' and 'input_ids' must be given", "text")
    if body.text is not None:
        is_batch = isinstance(body.text, list)
        texts = body.text if is_batch else [body.text]
        prompts = [ctx.tokenizer.encode(t) for t in texts]
        field = "text"
    else:
        prompts = token_id_lists(body.input_ids, "input_ids")
        is_batch = bool(body.input_ids) and isinstance(body.input_ids[0], list)
        field = "input_ids"
    if not prompts:
        raise ApiError(f"'{field}' is an empty batch", field)
    raw_params = body.sampling_params
    if isinstance(raw_params, list) and len(raw_params) != len(prompts):
        raise ApiError(
            f"sampling_params has {len(raw_params)} entries for {len(prompts)} prompts",
            "sampling_params",
        )
    rids = body.rid if isinstance(body.rid, list) else None
    if rids is not None and len(rids) != len(prompts):
        raise ApiError(f"rid has {len(rids)} entries for {len(prompts)} prompts", "rid")
    rank = routed_rank(body, ctx.args.num_dp_slots)
    reqs: list[GenerateRequest] = []
    for i, ids in enumerate(prompts):
        item = f"{field}[{i}]" if is_batch else field
        ctx.limits.check_prompt(ids, item)
        if body.return_logprob and body.logprob_start_len >= len(ids):
            raise ApiError(
                f"logprob_start_len={body.logprob_start_len} must be less than the prompt's "
                f"{len(ids)} tokens ({item})",
                "logprob_start_len",
            )
        prefix = f"sampling_params[{i}]." if isinstance(raw_params, list) else "sampling_params."
        params = sampling_body(
            raw_params[i] if isinstance(raw_params, list) else raw_params, prefix.rstrip(".")
        )
        max_new = ctx.limits.resolve_max_new(
            len(ids), params.max_new_tokens, DEFAULT_MAX_NEW_TOKENS, f"{prefix}max_new_tokens"
        )
        base = rids[i] if rids else (body.rid if isinstance(body.rid, str) else ctx.new_rid())
        for c in range(params.n):
            sampling = sampling_from_body(params, max_new, ctx.limits.vocab_size, prefix)
            if params.n > 1 and sampling.seed is not None:
                sampling = msgspec.structs.replace(sampling, seed=sampling.seed + c)
            reqs.append(
                GenerateRequest(
                    rid=base if params.n == 1 else f"{base}-{c}",
                    input_ids=ids,
                    sampling=sampling,
                    stream=body.stream,
                    return_logprob=body.return_logprob,
                    logprob_start_len=body.logprob_start_len if body.return_logprob else -1,
                    top_logprobs_num=body.top_logprobs_num,
                    routed_dp_rank=rank,
                )
            )
        is_batch = is_batch or params.n > 1
    return with_bootstrap(body, reqs, ctx.args.disaggregation_mode), is_batch


def _logprob_entries(ctx: ServerContext, logprobs, ids, with_text: bool) -> list:
    texts = [ctx.tokenizer.decode([t], skip_special_tokens=False) for t in ids] if with_text else None
    return [
        [lp, tok, texts[i] if texts else None] for i, (lp, tok) in enumerate(zip(logprobs, ids))
    ]


def _top_entries(ctx: ServerContext, tops, with_text: bool) -> list:
    out = []
    for top in tops:
        if not top.token_ids:
            out.append(None)
            continue
        out.append(_logprob_entries(ctx, top.logprobs, top.token_ids, with_text))
    return out


def response_json(ctx: ServerContext, out: RequestOutput, body: GenerateBody, prompt: list[int]):
    meta = {
        "id": out.rid,
        "finish_reason": None if out.finish_reason is None else _reason(out),
        "prompt_tokens": out.prompt_tokens,
        "completion_tokens": out.completion_tokens,
        "cached_tokens": 0,
        "e2e_latency": round(out.e2e_latency, 6),
        "dp_rank": out.dp_rank,
    }
    if body.return_logprob:
        with_text = body.return_text_in_logprobs
        start = out.input_logprob_start
        meta["input_token_logprobs"] = _logprob_entries(
            ctx, out.input_logprobs, prompt[start:], with_text
        )
        meta["output_token_logprobs"] = _logprob_entries(
            ctx, out.output_logprobs, out.output_ids, with_text
        )
        if body.top_logprobs_num:
            meta["input_top_logprobs"] = _top_entries(ctx, out.input_top_logprobs, with_text)
            meta["output_top_logprobs"] = _top_entries(ctx, out.output_top_logprobs, with_text)
    return {"text": out.text, "output_ids": out.output_ids, "meta_info": meta}


def _reason(out: RequestOutput) -> dict:
    reason = msgspec.to_builtins(out.finish_reason)
    reason.pop("status", None)
    return reason


async def handle_generate(request: web.Request) -> web.StreamResponse:
    ctx: ServerContext = request.app[CTX]
    ctx.check_accepting()
    body = decode_json(await request.read(), GenerateBody)
    reqs, is_batch = build_requests(ctx, body)
    ctx.check_rids_free(reqs)
    if not body.stream:
        outs = await collect(ctx, reqs)
        for out in outs:
            if (error := abort_error(out)) is not None:
                return error.response()
        results = [response_json(ctx, o, body, r.input_ids) for o, r in zip(outs, reqs)]
        return web.json_response(results if is_batch else results[0])
    response = await sse.open_stream(request)
    async with aclosing(stream(ctx, reqs)) as events:
        async for i, out in events:
            if (error := abort_error(out)) is not None:
                await sse.send_event(response, error.body())
                break
            chunk = response_json(ctx, out, body, reqs[i].input_ids)
            if is_batch:
                chunk["index"] = i
            await sse.send_event(response, chunk)
    await sse.send_done(response)
    return response
