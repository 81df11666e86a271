"""What the router needs to know about a request body, and the fields it adds to it.

The body is decoded into a plain dict and re-encoded after adding fields, so every field the
client sent reaches the workers unchanged (pass-through); the router only *adds*:

* `rid` (when the body has none): the request id (`X-Request-Id`, else a fresh uuid4 hex). A
  `/generate` batch gets one rid per prompt, `<id>-<i>`; with `n > 1` the workers derive one
  per sample from it (`<rid>-<c>` on /generate, `<id>-<prompt * n + c>` on the OpenAI routes),
  so every engine request of a batch has a distinct rid.
* PD mode: `bootstrap_host` (the chosen prefill's host), `bootstrap_port` (its bootstrap port)
  and `bootstrap_room`: one fresh random integer in [0, 2^63) when the request makes a single
  engine request, else a list with one room per engine request, prompt-major
  (index = prompt_index * n + sample_index). Rooms chosen by the client are replaced: the
  rendezvous belongs to the router.
* `--dp-aware`: rooms with `room % num_dp_slots == rank` for the prefill rank the router chose,
  and `routed_dp_rank` on the decode leg only.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from common.server.errors import ApiError
from router.policies.base import RouteKey

ROOM_LIMIT = 2**63  # rooms are in [0, ROOM_LIMIT)
GENERATE, COMPLETIONS, CHAT = "generate", "completions", "chat"


@dataclass(slots=True)
class RequestPlan:
    route: str
    body: dict[str, Any]
    samples_per_prompt: list[int]  # n of each prompt
    is_batch: bool  # several prompts, or a list-valued prompt field
    stream: bool
    wants_input_logprobs: bool  # /generate with return_logprob: merge prefill's prompt logprobs
    key: RouteKey

    @property
    def num_prompts(self) -> int:
        return len(self.samples_per_prompt)

    @property
    def num_rooms(self) -> int:
        return sum(self.samples_per_prompt)


def _n(params: Any) -> int:
    n = params.get("n", 1) if isinstance(params, dict) else 1
    return n if type(n) is int and n >= 1 else 1  # a bad n is the worker's to reject


def _generate_shape(body: dict) -> tuple[list[int], bool, RouteKey]:
    text, ids = body.get("text"), body.get("input_ids")
    if isinstance(text, list):
        prompts, key = len(text), RouteKey(text=text[0] if text and isinstance(text[0], str)
                                           else None)
        is_batch = True
    elif ids is not None and isinstance(ids, list) and ids and isinstance(ids[0], list):
        prompts, key, is_batch = len(ids), RouteKey(token_ids=_ids(ids[0])), True
    else:
        prompts, is_batch = 1, False
        key = RouteKey(text=text) if isinstance(text, str) else RouteKey(token_ids=_ids(ids))
    params = body.get("sampling_params")
    if isinstance(params, list) and len(params) == prompts:
        samples = [_n(p) for p in params]
    else:
        samples = [_n(params)] * max(prompts, 1)
    return samples, is_batch, key


def _ids(value: Any) -> tuple[int, ...] | None:
    if isinstance(value, list) and all(type(v) is int for v in value):
        return tuple(value)
    return None


def _completion_shape(body: dict) -> tuple[int, bool, RouteKey]:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return 1, False, RouteKey(text=prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return len(prompt), True, RouteKey(text=prompt[0])
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
        return len(prompt), True, RouteKey(token_ids=_ids(prompt[0]))
    return 1, False, RouteKey(token_ids=_ids(prompt))


def _chat_text(messages: Any) -> str | None:
    if not isinstance(messages, list):
        return None
    parts = []
    for m in messages:
        if not isinstance(m, dict):
            continue
        content = m.get("content")
        if isinstance(content, list):  # content parts: keep the text ones
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        parts.append(f"{m.get('role', '')}:{content or ''}\n")
    return "".join(parts) or None


def plan_request(route: str, body: Any) -> RequestPlan:
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    stream = body.get("stream") is True
    if route == GENERATE:
        samples, is_batch, key = _generate_shape(body)
        wants = body.get("return_logprob") is True
        return RequestPlan(route, body, samples, is_batch, stream, wants, key)
    n = _n(body)
    if route == COMPLETIONS:
        prompts, is_batch, key = _completion_shape(body)
    else:
        prompts, is_batch, key = 1, False, RouteKey(text=_chat_text(body.get("messages")))
    return RequestPlan(route, body, [n] * prompts, is_batch, stream, False, key)


def add_rid(plan: RequestPlan, request_id: str) -> None:
    if "rid" in plan.body:
        return
    if plan.route == GENERATE and plan.is_batch:
        plan.body["rid"] = [f"{request_id}-{i}" for i in range(plan.num_prompts)]
    else:
        plan.body["rid"] = request_id


def random_rooms(count: int, rng: random.Random) -> list[int]:
    return [rng.getrandbits(63) for _ in range(count)]


def room_for_rank(rank: int, num_slots: int, rng: random.Random) -> int:
    """A uniformly random room in [0, 2^63) with room % num_slots == rank."""
    base = rng.randrange(ROOM_LIMIT // num_slots)
    return base * num_slots + rank


def add_bootstrap(plan: RequestPlan, host: str, port: int | None, rooms: list[int]) -> None:
    plan.body["bootstrap_host"] = host
    plan.body["bootstrap_port"] = port
    single = plan.num_rooms == 1 and not plan.is_batch
    plan.body["bootstrap_room"] = rooms[0] if single else rooms
