"""Model configuration read from a Hugging Face-format folder (`config.json`).

Only what the engine needs is kept, normalised across config dialects:
- `rope_theta` may sit at the top level (hub checkpoints) or inside transformers 5.x
  `rope_parameters` (together with the scaling type);
- `rope_scaling` (Llama 3 style) is folded into one `RopeScaling` value;
- `head_dim` defaults to hidden_size / num_attention_heads.
An architecture we cannot run is a clear start-up error naming the supported ones.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class UnsupportedModelError(ValueError):
    """The checkpoint asks for something this engine cannot run."""


@dataclass(frozen=True, slots=True)
class RopeScaling:
    rope_type: str  # "default", "linear", "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    sliding_window: int | None
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None

    def kv_bytes_per_token(self, element_size: int) -> int:
        """K and V of every layer for one token."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * element_size


def _int_list(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _rope_settings(raw: dict[str, Any]) -> tuple[float, RopeScaling]:
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or {}
    # transformers 5.x keeps theta and the scaling type together in rope_parameters.
    merged = {**params, **scaling}
    theta = float(raw.get("rope_theta", merged.get("rope_theta", 10000.0)))
    rope_type = merged.get("rope_type", merged.get("type", "default")) or "default"
    if rope_type not in ("default", "linear", "llama3"):
        raise UnsupportedModelError(
            f"rope type {rope_type!r} is not supported (supported: default, linear, llama3)"
        )
    fields = {k: merged[k] for k in RopeScaling.__slots__ if k in merged and k != "rope_type"}
    return theta, RopeScaling(rope_type=rope_type, **fields)


def _sliding_window(raw: dict[str, Any]) -> int | None:
    window = raw.get("sliding_window")
    if not window:
        return None
    if raw.get("model_type") == "mistral":
        return int(window)
    if raw.get("use_sliding_window"):
        raise UnsupportedModelError("per-layer sliding windows (use_sliding_window) are not supported")
    return None


def load_model_config(model_path: str | Path) -> ModelConfig:
    path = Path(model_path) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"--model-path {model_path}: no config.json found")
    raw = json.loads(path.read_text())
    # Imported here so that the registry can import this module without a cycle.
    from common.engine.models import SUPPORTED_ARCHITECTURES

    archs = raw.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise UnsupportedModelError(
            f"architecture {archs or raw.get('model_type')!r} is not supported; "
            f"supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
        )
    theta, scaling = _rope_settings(raw)
    hidden = int(raw["hidden_size"])
    heads = int(raw["num_attention_heads"])
    model_type = raw.get("model_type", "")
    gen_path = Path(model_path) / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
    eos = _int_list(raw.get("eos_token_id")) + _int_list(gen.get("eos_token_id"))
    return ModelConfig(
        architecture=arch,
        model_type=model_type,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or hidden // heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        # Qwen2's q/k/v biases are implied by its architecture, not declared here.
        attention_bias=bool(raw.get("attention_bias", False)),
        mlp_bias=bool(raw.get("mlp_bias", False)),
        sliding_window=_sliding_window(raw),
        eos_token_ids=tuple(dict.fromkeys(eos)),
        bos_token_id=raw.get("bos_token_id"),
    )
