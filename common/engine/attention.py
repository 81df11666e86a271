"""Paged attention on top of `torch.nn.functional.scaled_dot_product_attention`.

New keys/values are written into the pool at `out_slots`; every request then reads its whole
context back from the pool through `kv_slots`, so prefix, chunked-prefill and decode batches all
share one code path. Runs on any `torch.device`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from common.engine.forward_batch import ForwardBatch
from common.engine.kv_pool import PagedKVPool


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer: int,
    pool: PagedKVPool,
    fb: ForwardBatch,
    scale: float,
) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, Hkv, D]. Returns [T, H * D]."""
    k_cache, v_cache = pool.layer(layer)
    # index_copy_/index_select move whole rows: several times faster on CPU than advanced
    # indexing with the same indices.
    k_cache.index_copy_(0, fb.out_slots, k)
    v_cache.index_copy_(0, fb.out_slots, v)
    num_tokens, num_heads, head_dim = q.shape
    batch, q_len = fb.num_reqs, fb.max_q_len
    if fb.fresh_causal:
        # Fresh prompts of equal length: the new keys are the whole context, no pool read.
        out = F.scaled_dot_product_attention(
            q.view(batch, q_len, num_heads, head_dim).transpose(1, 2),
            k.view(batch, q_len, -1, head_dim).transpose(1, 2),
            v.view(batch, q_len, -1, head_dim).transpose(1, 2),
            is_causal=True,
            scale=scale,
            enable_gqa=True,
        )
        return out.transpose(1, 2).reshape(num_tokens, num_heads * head_dim)
    if fb.q_gather is not None:
        q = q[fb.q_gather]  # [B, Qmax, H, D]
    else:
        q = q.view(batch, q_len, num_heads, head_dim)
    kv_shape = (batch, fb.kv_slots.shape[1], k.shape[1], head_dim)
    flat_slots = fb.kv_slots.view(-1)
    keys = k_cache.index_select(0, flat_slots).view(kv_shape).transpose(1, 2)  # [B, Hkv, K, D]
    values = v_cache.index_select(0, flat_slots).view(kv_shape).transpose(1, 2)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), keys, values, attn_mask=fb.attn_mask, scale=scale, enable_gqa=True
    )  # [B, H, Qmax, D]
    out = out.transpose(1, 2).reshape(batch * q_len, num_heads * head_dim)
    if fb.q_scatter is not None:
        out = out[fb.q_scatter]
    return out
