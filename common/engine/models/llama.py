"""Llama (1/2/3) and derivatives such as SmolLM: no biases, plain q/k."""

from __future__ import annotations

from common.engine.models.layers import CausalLM


class LlamaForCausalLM(CausalLM):
    pass
