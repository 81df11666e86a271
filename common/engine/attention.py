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
    k_cache[fb.out_slots] = k
    v_cache[fb.out_slots] = v
    num_tokens, num_heads, head_dim = q.shape
    if fb.fresh_causal:
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0),
            is_causal=True,
            scale=scale,
            enable_gqa=True,
        )
        return out.squeeze(0).transpose(0, 1).reshape(num_tokens, num_heads * head_dim)
    batch, q_len = fb.num_reqs, fb.max_q_len
    if fb.q_gather is not None:
        q = q[fb.q_gather]  # [B, Qmax, H, D]
    else:
        q = q.view(batch, q_len, num_heads, head_dim)
    keys = k_cache[fb.kv_slots].transpose(1, 2)  # [B, Hkv, Kmax, D]
    values = v_cache[fb.kv_slots].transpose(1, 2)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), keys, values, attn_mask=fb.attn_mask, scale=scale, enable_gqa=True
    )  # [B, H, Qmax, D]
    out = out.transpose(1, 2).reshape(batch * q_len, num_heads * head_dim)
    if fb.q_scatter is not None:
        out = out[fb.q_scatter]
    return out
