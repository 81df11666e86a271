"""Model runner: turns scheduled segments into one forward pass and returns logits.

A segment is `(req, start, length)`: run `req.fill_ids[start:start + length]` at positions
`start..start + length - 1`, whose KV pages the scheduler has already allocated. Decode steps
are segments of length 1. Logits are computed only for the rows that need them: the last row of
a segment that completes its request's prefill (or any decode row), plus every row of a segment
whose request asked for prompt logprobs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.engine.forward_batch import ForwardBatch
from common.engine.kv_pool import PagedKVPool
from common.engine.models.layers import CausalLM
from common.engine.request import Req


@dataclass(slots=True)
class Segment:
    req: Req
    start: int
    length: int
    all_logits: bool = False  # every row (prompt logprobs), not only the last

    @property
    def end(self) -> int:
        return self.start + self.length

    @property
    def completes_fill(self) -> bool:
        return self.end == len(self.req.fill_ids)


@dataclass(slots=True)
class SegmentLogits:
    """Where each segment's logits are in the returned tensor: rows [first, first + count)."""

    first: int
    count: int


class ModelRunner:
    def __init__(self, model: CausalLM, pool: PagedKVPool, device: torch.device):
        self.model = model
        self.pool = pool
        self.device = device
        self.sliding_window = model.config.sliding_window

    def forward(self, segments: list[Segment]) -> tuple[torch.Tensor, list[SegmentLogits | None]]:
        input_ids, fb, where = self._build(segments)
        return self.model(input_ids, self.pool, fb), where

    def _build(self, segments: list[Segment]):
        dev, ps = self.device, self.pool.page_size
        batch = len(segments)
        lengths = [s.length for s in segments]
        starts = [s.start for s in segments]
        kv_lens = [s.end for s in segments]
        max_q, max_kv = max(lengths), max(kv_lens)
        tokens: list[int] = []
        logit_rows: list[int] = []
        where: list[SegmentLogits | None] = []
        offset = 0
        for s in segments:
            tokens.extend(s.req.fill_ids[s.start : s.end])
            if s.all_logits:
                where.append(SegmentLogits(len(logit_rows), s.length))
                logit_rows.extend(range(offset, offset + s.length))
            elif s.completes_fill:
                where.append(SegmentLogits(len(logit_rows), 1))
                logit_rows.append(offset + s.length - 1)
            else:
                where.append(None)
            offset += s.length

        max_pages = self.pool.pages_for(max_kv)
        page_table = torch.tensor(
            [s.req.pages[:max_pages] + [0] * (max_pages - len(s.req.pages[:max_pages]))
             for s in segments],
            dtype=torch.int64,
        )
        kv_slots = (page_table[:, :, None] * ps + torch.arange(ps)).view(batch, -1)[:, :max_kv]
        kv_slots = kv_slots.contiguous()
        starts_t = torch.tensor(starts)
        lengths_t = torch.tensor(lengths)
        kv_lens_t = torch.tensor(kv_lens)
        j = torch.arange(max_q)
        valid_q = j[None, :] < lengths_t[:, None]  # [B, Qmax]
        # Padding queries repeat the segment's last position: harmless, and never all-masked.
        q_pos = starts_t[:, None] + torch.minimum(j[None, :], (lengths_t - 1)[:, None])
        positions = q_pos[valid_q]
        rows = torch.arange(batch)[:, None].expand(batch, max_q)[valid_q]
        out_slots = kv_slots[rows, positions]

        # Fresh prompts of one length need neither the pool nor a mask: SDPA's causal path.
        fresh_causal = (
            max_q > 1
            and all(st == 0 for st in starts)
            and all(n == max_q for n in lengths)
            and (self.sliding_window is None or max_q <= self.sliding_window)
        )
        attn_mask = q_gather = q_scatter = None
        if not fresh_causal:
            k_pos = torch.arange(max_kv)
            visible = (k_pos[None, None, :] <= q_pos[:, :, None]) & (
                k_pos[None, None, :] < kv_lens_t[:, None, None]
            )
            if self.sliding_window is not None:
                visible &= k_pos[None, None, :] > q_pos[:, :, None] - self.sliding_window
            # Decode rows of one length see every slot: no mask needed.
            uniform_decode = max_q == 1 and min(kv_lens) == max_kv
            if not (uniform_decode and self.sliding_window is None):
                attn_mask = visible.unsqueeze(1).to(dev)
            if max_q > 1:
                seg_offsets = torch.cumsum(lengths_t, 0) - lengths_t
                q_gather = (seg_offsets[:, None] + (q_pos - starts_t[:, None])).to(dev)
                q_scatter = (torch.arange(batch * max_q).view(batch, max_q)[valid_q]).to(dev)
        fb = ForwardBatch(
            positions=positions.to(dev),
            out_slots=out_slots.to(dev),
            kv_slots=kv_slots.to(dev),
            attn_mask=attn_mask,
            q_gather=q_gather,
            q_scatter=q_scatter,
            num_reqs=batch,
            max_q_len=max_q,
            fresh_causal=fresh_causal,
            logit_rows=torch.tensor(logit_rows, dtype=torch.int64, device=dev),
        )
        return torch.tensor(tokens, dtype=torch.int64, device=dev), fb, where
