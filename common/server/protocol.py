"""HTTP request bodies (SGLang `/generate`, OpenAI completions and chat) and their validation.

Bodies are decoded with msgspec into the Structs below, so a wrong type or out-of-range value
becomes a 400 that names the field. Checks that need the model (token ids within the vocabulary,
prompt plus output within the context and the KV pool) are done by `Limits`.
Unknown top-level fields are accepted (clients and routers add their own); unknown sampling
parameters are refused, since a misspelt one would otherwise be silently ignored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from common.messages.sampling import SamplingParams
from common.messages.scheduler_input import GenerateRequest
from common.server.errors import ApiError, convert

NonNegInt = Annotated[int, Meta(ge=0)]
Temperature = Annotated[float, Meta(ge=0.0)]
Probability = Annotated[float, Meta(ge=0.0, le=1.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
RepetitionPenalty = Annotated[float, Meta(ge=0.01, le=10.0)]
TopK = Annotated[int, Meta(ge=-1)]
NumChoices = Annotated[int, Meta(ge=1, le=64)]
NumLogprobs = Annotated[int, Meta(ge=0, le=20)]
Seed = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]


class SamplingParamsBody(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """SGLang's `sampling_params` object."""

    max_new_tokens: NonNegInt | None = None
    min_new_tokens: NonNegInt = 0
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = -1
    min_p: Probability = 0.0
    repetition_penalty: RepetitionPenalty = 1.0
    frequency_penalty: Penalty = 0.0
    presence_penalty: Penalty = 0.0
    seed: Seed | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    logit_bias: dict[str, float] | None = None
    n: NumChoices = 1


Room = Annotated[int, Meta(ge=0, le=2**63 - 1)]


Port = Annotated[int, Meta(ge=1, le=65535)]


class DispatchFields(msgspec.Struct, kw_only=True):
    """Where the DP controller should send the request (SPEC section 2), and the PD
    rendezvous the router injects (SPEC section 4): one value, or a list with one per prompt
    (per sample when n > 1)."""

    routed_dp_rank: Annotated[int, Meta(ge=-(2**31), le=2**31)] | None = None
    bootstrap_room: Room | list[Room] | None = None
    bootstrap_host: Annotated[str, Meta(min_length=1)] | list[str] | None = None
    bootstrap_port: Port | list[Port] | None = None


class GenerateBody(DispatchFields, kw_only=True):
    text: str | list[str] | None = None
    input_ids: Any = None  # list[int] or list[list[int]]: checked by `token_id_lists`
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    rid: str | list[str] | None = None
    stream: bool = False
    return_logprob: bool = False
    logprob_start_len: Annotated[int, Meta(ge=-1)] = -1
    top_logprobs_num: NumLogprobs = 0
    return_text_in_logprobs: bool = False


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False


class _OpenAISampling(DispatchFields, kw_only=True):
    """Fields shared by completions and chat, including vLLM/SGLang extensions."""

    model: str | None = None
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    n: NumChoices = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    logit_bias: dict[str, float] | None = None
    seed: Seed | None = None
    user: str | None = None
    top_k: TopK = -1
    min_p: Probability = 0.0
    repetition_penalty: RepetitionPenalty = 1.0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    min_tokens: NonNegInt = 0
    rid: str | None = None


class CompletionBody(_OpenAISampling, kw_only=True):
    prompt: Any = None  # str | list[str] | list[int] | list[list[int]]
    max_tokens: NonNegInt | None = None
    logprobs: NumLogprobs | None = None
    echo: bool = False
    best_of: NumChoices | None = None
    suffix: str | None = None


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatBody(_OpenAISampling, kw_only=True):
    messages: list[ChatMessage]
    max_tokens: NonNegInt | None = None
    max_completion_tokens: NonNegInt | None = None
    logprobs: bool = False
    top_logprobs: NumLogprobs | None = None
    tools: list[dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class Limits:
    """Model-dependent bounds, known once the scheduler has started."""

    vocab_size: int
    context_length: int
    max_total_tokens: int

    @property
    def max_sequence(self) -> int:
        return min(self.context_length, self.max_total_tokens)

    def check_prompt(self, ids: list[int], param: str) -> None:
        if not ids:
            raise ApiError("the prompt is empty", param)
        bad = next((t for t in ids if t < 0 or t >= self.vocab_size), None)
        if bad is not None:
            raise ApiError(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})", param)
        if len(ids) >= self.max_sequence:
            raise ApiError(
                f"the prompt has {len(ids)} tokens; the limit is {self.max_sequence - 1} "
                f"(context length {self.context_length}, KV pool {self.max_total_tokens} tokens)",
                param,
            )

    def resolve_max_new(self, prompt_len: int, asked: int | None, default: int | None,
                        param: str) -> int:
        room = self.max_sequence - prompt_len
        if asked is None:
            return room if default is None else min(default, room)
        if asked > room:
            raise ApiError(
                f"{param}={asked} plus the prompt's {prompt_len} tokens exceeds the limit of "
                f"{self.max_sequence} tokens (context length {self.context_length}, "
                f"KV pool {self.max_total_tokens} tokens)",
                param,
            )
        return asked


def routed_rank(body: DispatchFields, num_dp_slots: int) -> int | None:
    rank = body.routed_dp_rank
    if rank is not None and not 0 <= rank < num_dp_slots:
        raise ApiError(
            f"routed_dp_rank {rank} is out of range [0, {num_dp_slots})", "routed_dp_rank"
        )
    return rank


def _per_sample(value, num: int, name: str, what: str) -> list:
    if not isinstance(value, list):
        return [value] * num
    if len(value) != num:
        raise ApiError(f"{name} has {len(value)} entries for {num} {what}", name)
    return value



def with_bootstrap(body: DispatchFields, reqs: list[GenerateRequest],
                   disaggregation_mode: str) -> list[GenerateRequest]:
    """Spread the PD rendezvous fields over the engine requests (prompt-major, then `n`
    samples): a list gives one value per request, a single value applies to all. Prefill needs
    a room and decode all three fields; each PD request needs a room of its own."""
    num = len(reqs)
    what = "requests (one per prompt, times n samples)"
    rooms = _per_sample(body.bootstrap_room, num, "bootstrap_room", what)
    hosts = _per_sample(body.bootstrap_host, num, "bootstrap_host", what)
    ports = _per_sample(body.bootstrap_port, num, "bootstrap_port", what)
    if disaggregation_mode != "null":
        needed = ["bootstrap_room"] if disaggregation_mode == "prefill" else [
            "bootstrap_host", "bootstrap_port", "bootstrap_room"]
        for name in needed:
            if getattr(body, name) is None:
                raise ApiError(f"a {disaggregation_mode} service needs {name}: send requests "
                               "through the PD router, which injects the bootstrap fields", name)
        if len(set(rooms)) != num:
            raise ApiError(f"every request needs its own bootstrap_room: give a list of {num} "
                           f"distinct rooms, one per prompt and sample", "bootstrap_room")
    if all(v is None for v in (body.bootstrap_room, body.bootstrap_host, body.bootstrap_port)):
        return reqs
    return [msgspec.structs.replace(r, bootstrap_room=room, bootstrap_host=host,
                                    bootstrap_port=port)
            for r, room, host, port in zip(reqs, rooms, hosts, ports)]


def token_id_lists(value: Any, param: str) -> list[list[int]] | None:
    """Accepts list[int] (one prompt) or list[list[int]] (a batch); None if `value` is None."""
    if value is None:
        return None
    if isinstance(value, list) and value and all(isinstance(v, list) for v in value):
        return [_int_list(v, f"{param}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, list):
        return [_int_list(value, param)]
    raise ApiError(f"{param} must be a list of token ids or a list of such lists", param)


def _int_list(value: list, param: str) -> list[int]:
    if not all(type(v) is int for v in value):
        raise ApiError(f"{param} must contain only integer token ids", param)
    return value


def stop_list(stop: str | list[str] | None) -> list[str]:
    """Empty strings are dropped: "" would match before any text and stop at once."""
    if stop is None:
        return []
    return [s for s in ([stop] if isinstance(stop, str) else stop) if s]


def logit_bias_map(bias: dict[str, float] | None, vocab_size: int, param: str) -> dict[int, float]:
    out: dict[int, float] = {}
    for key, value in (bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise ApiError(f"{param} keys must be token ids, got {key!r}", param) from None
        if not 0 <= token < vocab_size:
            raise ApiError(f"{param}: token id {token} is outside the vocabulary", param)
        if not -100.0 <= value <= 100.0:
            raise ApiError(f"{param}: bias {value} must be in [-100, 100]", param)
        out[token] = float(value)
    return out


def check_token_ids(ids: list[int] | None, vocab_size: int, param: str) -> list[int]:
    for t in ids or []:
        if not 0 <= t < vocab_size:
            raise ApiError(f"token id {t} is outside the vocabulary [0, {vocab_size})", param)
    return list(ids or [])


# Below this a temperature only overflows the logits (NaN probabilities): it means greedy.
GREEDY_TEMPERATURE_EPS = 1e-5


def sampling_from_body(
    body: SamplingParamsBody, max_new_tokens: int, vocab_size: int, prefix: str
) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=max_new_tokens,
        min_new_tokens=body.min_new_tokens,
        temperature=body.temperature if body.temperature >= GREEDY_TEMPERATURE_EPS else 0.0,
        top_p=body.top_p,
        # top_k >= vocab keeps every token; clamping also keeps huge values off the tensors.
        top_k=body.top_k if 0 < body.top_k < vocab_size else -1,
        min_p=body.min_p,
        repetition_penalty=body.repetition_penalty,
        frequency_penalty=body.frequency_penalty,
        presence_penalty=body.presence_penalty,
        seed=body.seed,
        stop=stop_list(body.stop),
        stop_token_ids=check_token_ids(body.stop_token_ids, vocab_size, f"{prefix}stop_token_ids"),
        ignore_eos=body.ignore_eos,
        skip_special_tokens=body.skip_special_tokens,
        no_stop_trim=body.no_stop_trim,
        logit_bias=logit_bias_map(body.logit_bias, vocab_size, f"{prefix}logit_bias"),
    )


def openai_sampling(body: _OpenAISampling) -> SamplingParamsBody:
    """The OpenAI fields mapped onto SGLang's sampling parameters (max tokens set later)."""
    return SamplingParamsBody(
        min_new_tokens=body.min_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        min_p=body.min_p,
        repetition_penalty=body.repetition_penalty,
        frequency_penalty=body.frequency_penalty,
        presence_penalty=body.presence_penalty,
        seed=body.seed,
        stop=body.stop,
        stop_token_ids=body.stop_token_ids,
        ignore_eos=body.ignore_eos,
        skip_special_tokens=body.skip_special_tokens,
        logit_bias=body.logit_bias,
        n=body.n,
    )


def sampling_body(raw: dict[str, Any] | None, prefix: str) -> SamplingParamsBody:
    return convert(raw or {}, SamplingParamsBody, prefix)
