"""Start-up of the engine's heavy parts: device and dtype resolution, model weights, KV pool.

The KV capacity comes from `--max-total-tokens` or, failing that, from a share of the memory
left after loading the weights (`--mem-fraction-static`: 0.85 of free GPU memory, 0.1 of the
host's available memory on CPU). Capacity is rounded down to whole pages.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from common.config import ServerArgs
from common.engine.kv_pool import PagedKVPool
from common.engine.model_config import ModelConfig, load_model_config
from common.engine.models import MODEL_CLASSES
from common.engine.models.layers import CausalLM
from common.engine.weights import load_weights

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, slots=True)
class LoadedModel:
    config: ModelConfig
    model: CausalLM
    pool: PagedKVPool
    device: torch.device
    dtype: torch.dtype
    context_length: int


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but no CUDA device is available")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


def _available_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 4 << 30


def kv_capacity_tokens(args: ServerArgs, bytes_per_token: int, device: torch.device) -> int:
    if args.max_total_tokens is not None:
        return args.max_total_tokens
    fraction = args.mem_fraction_static or (0.85 if device.type == "cuda" else 0.1)
    return int(_available_bytes(device) * fraction) // bytes_per_token


def load_engine_parts(args: ServerArgs, model_path: str) -> LoadedModel:
    cfg = load_model_config(model_path)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    context_length = args.context_length or cfg.max_position_embeddings
    torch.manual_seed(args.random_seed)
    with torch.device("meta"):
        model = MODEL_CLASSES[cfg.architecture](cfg, max_positions=context_length)
    model = model.to_empty(device=device)
    # Buffers (the RoPE tables) do not survive `to_empty`: rebuild them on the device.
    model.rotary.rebuild(device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    load_weights(model, model_path)
    model = model.to(dtype).train(False)
    element = torch.tensor([], dtype=dtype).element_size()
    capacity = kv_capacity_tokens(args, cfg.kv_bytes_per_token(element), device)
    num_pages = capacity // args.page_size
    if num_pages < 1:
        raise ValueError(
            f"KV pool of {capacity} tokens is smaller than one page (--page-size "
            f"{args.page_size}); raise --max-total-tokens or --mem-fraction-static"
        )
    pool = PagedKVPool(
        num_pages, args.page_size, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype, device
    )
    logger.info(
        "loaded %s (%s) on %s as %s; KV pool %d tokens in %d pages of %d",
        cfg.architecture, model_path, device, dtype, pool.capacity_tokens, num_pages,
        args.page_size,
    )
    return LoadedModel(cfg, model, pool, device, dtype, context_length)
