"""Architecture registry: the `architectures` name in config.json -> model class."""

from __future__ import annotations

from common.engine.models.layers import CausalLM
from common.engine.models.llama import LlamaForCausalLM
from common.engine.models.mistral import MistralForCausalLM
from common.engine.models.qwen2 import Qwen2ForCausalLM
from common.engine.models.qwen3 import Qwen3ForCausalLM

MODEL_CLASSES: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}
SUPPORTED_ARCHITECTURES = frozenset(MODEL_CLASSES)
