"""Qwen2 / Qwen2.5: biases on the q, k and v projections (none on o_proj)."""

from __future__ import annotations

from common.engine.models.layers import CausalLM


class Qwen2ForCausalLM(CausalLM):
    qkv_bias = True
