"""Load Hugging Face safetensors checkpoints (single file or sharded) into our modules.

Checkpoint names map one to one onto ours except for the fused projections: q/k/v become
`qkv_proj` and gate/up become `gate_up_proj`, concatenated along the output dimension. Every
parameter must be filled exactly once; a missing or unexpected tensor is a start-up error.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from common.engine.models.layers import CausalLM

_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def checkpoint_files(model_path: Path) -> list[Path]:
    index = model_path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_path / s for s in shards]
    single = model_path / "model.safetensors"
    if single.is_file():
        return [single]
    raise FileNotFoundError(f"--model-path {model_path}: no model.safetensors(.index.json) found")


def load_weights(model: CausalLM, model_path: str | Path) -> None:
    params = dict(model.named_parameters())
    pieces: dict[str, list[torch.Tensor | None]] = {}
    filled: set[str] = set()
    for file in checkpoint_files(Path(model_path)):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if name.endswith(_IGNORED_SUFFIXES):
                    continue
                if name == "lm_head.weight" and model.config.tie_word_embeddings:
                    continue
                tensor = f.get_tensor(name)
                module_path, _, leaf = name.rpartition(".")
                parent, _, proj = module_path.rpartition(".")
                if proj in _FUSED:
                    fused, slot = _FUSED[proj]
                    target = f"{parent}.{fused}.{leaf}"
                    parts = pieces.setdefault(target, [None] * (3 if fused == "qkv_proj" else 2))
                    parts[slot] = tensor
                    if all(p is not None for p in parts):
                        _copy(params, target, torch.cat(parts, dim=0), filled)
                else:
                    _copy(params, name, tensor, filled)
    missing = set(params) - filled
    if model.config.tie_word_embeddings:
        missing.discard("lm_head.weight")
    if missing:
        raise ValueError(f"checkpoint is missing tensors: {sorted(missing)[:8]}")


def _copy(params: dict, name: str, tensor: torch.Tensor, filled: set[str]) -> None:
    if name not in params:
        raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
    param = params[name]
    if param.shape != tensor.shape:
        raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != {tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(tensor)
    filled.add(name)
