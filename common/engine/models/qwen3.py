"""Qwen3: per-head RMSNorm on queries and keys before RoPE, no q/k/v biases."""

from __future__ import annotations

from common.engine.models.layers import CausalLM


class Qwen3ForCausalLM(CausalLM):
    qk_norm = True
