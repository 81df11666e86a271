"""Prompt logprobs in PD mode: only the prefill side computes them, so the router merges them.

With `/generate` and `return_logprob` (+ `logprob_start_len`), the prefill reply's
`meta_info.input_token_logprobs` (and `input_top_logprobs`) are put in front of whatever the
decode reply has under the same keys (SGLang's router does the same), item by item for a batch.
"""

from __future__ import annotations

from typing import Any

import msgspec

PROMPT_FIELDS = ("input_token_logprobs", "input_top_logprobs")


def prompt_logprobs(item: Any) -> dict | None:
    """The prompt-logprob fields of one prefill item (a reply or a stream chunk), if any."""
    meta = item.get("meta_info") if isinstance(item, dict) else None
    if not isinstance(meta, dict):
        return None
    found = {f: meta[f] for f in PROMPT_FIELDS if isinstance(meta.get(f), list)}
    return found or None


def merge_item(decode_item: Any, prefill_part: dict | None) -> None:
    meta = decode_item.get("meta_info") if isinstance(decode_item, dict) else None
    if prefill_part is None or not isinstance(meta, dict):
        return
    for field, values in prefill_part.items():
        meta[field] = list(values) + list(meta.get(field) or [])


def merge_bodies(decode_body: bytes, prefill_body: bytes) -> bytes:
    """A non-streaming decode reply with the prefill reply's prompt logprobs merged in."""
    try:
        decoded = msgspec.json.decode(decode_body)
        prefilled = msgspec.json.decode(prefill_body)
    except msgspec.DecodeError:
        return decode_body  # not ours to repair: pass the decode answer on as it is
    if isinstance(decoded, list) and isinstance(prefilled, list):
        for d_item, p_item in zip(decoded, prefilled):
            merge_item(d_item, prompt_logprobs(p_item))
    else:
        merge_item(decoded, prompt_logprobs(prefilled))
    return msgspec.json.encode(decoded)
