"""Rotary position embeddings: inverse frequencies (default, linear, Llama 3) and application.

cos/sin are computed as `positions * inv_freq` in float32, the same arithmetic as Hugging Face,
so logits agree to rounding with the reference implementation.
"""

from __future__ import annotations

import math

import torch

from common.engine.model_config import RopeScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type != "llama3":
        return inv_freq
    # Llama 3: keep high frequencies, divide low ones by `factor`, blend in between.
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(torch.nn.Module):
    """Holds a cos/sin table for every position up to `max_positions`."""

    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling, max_positions: int):
        super().__init__()
        self._spec = (head_dim, theta, scaling, max_positions)
        self.rebuild()

    def rebuild(self, device: torch.device | None = None) -> None:
        """(Re)compute the tables, e.g. after the module was materialised from the meta device."""
        head_dim, theta, scaling, max_positions = self._spec
        inv_freq = inverse_frequencies(head_dim, theta, scaling)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1).to(device)
        self.register_buffer("cos_table", emb.cos(), persistent=False)
        self.register_buffer("sin_table", emb.sin(), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """Per-token tables shaped [T, 1, head_dim] to broadcast over heads."""
        cos = self.cos_table[positions].to(dtype).unsqueeze(1)
        sin = self.sin_table[positions].to(dtype).unsqueeze(1)
        return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim] in the rotate-half layout used by Hugging Face checkpoints."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
