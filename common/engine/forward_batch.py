"""What one forward pass needs besides token ids: positions, KV slots and attention layout.

Built by the model runner for each scheduled batch and passed down through every layer. There
is no global forward state: the batch object travels as an argument.

Layout (B requests, T new tokens in total, each request's new tokens contiguous):
- `positions[T]`, `out_slots[T]`: position of each new token and the KV slot it is written to;
- `kv_slots[B, Kmax]`: every KV slot each request attends to (its prefix plus the new tokens),
  padded; `attn_mask[B, 1, Qmax, Kmax]` says which of them each query may see (causal,
  sliding window, padding);
- `q_gather[B, Qmax]` / `q_scatter[T]`: move new tokens into the padded [B, Qmax] layout and
  back. Decode batches have Qmax == 1, so both are identities and are skipped.
- `fresh_causal`: a single request with no cached prefix; attention can run on the new keys
  directly with `is_causal`, without reading the pool.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class ForwardBatch:
    positions: torch.Tensor
    out_slots: torch.Tensor
    kv_slots: torch.Tensor
    attn_mask: torch.Tensor | None
    q_gather: torch.Tensor | None
    q_scatter: torch.Tensor | None
    num_reqs: int
    max_q_len: int
    fresh_causal: bool
    # Rows of the flat token dimension whose logits are needed (last token, or every prompt
    # token for requests that asked for input logprobs).
    logit_rows: torch.Tensor
