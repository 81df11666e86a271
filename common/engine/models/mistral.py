"""Mistral: the Llama layer stack; its sliding window is applied by the attention mask."""

from __future__ import annotations

from common.engine.models.layers import CausalLM


class MistralForCausalLM(CausalLM):
    pass
