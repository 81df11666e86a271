"""Building blocks shared by the Llama-family architectures.

Modules keep Hugging Face parameter names where they hold the same tensor, so checkpoints map
one to one; q/k/v and gate/up are fused into one matrix each (fewer, larger matmuls per layer),
and `weights.py` concatenates the checkpoint's pieces when loading.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from common.engine.attention import paged_attention
from common.engine.forward_batch import ForwardBatch
from common.engine.kv_pool import PagedKVPool
from common.engine.model_config import ModelConfig
from common.engine.rope import RotaryEmbedding, apply_rotary


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class GatedMLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.intermediate = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 1:
            gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        else:
            # Measured on CPU: for several rows two half-size matmuls beat one fused matmul
            # followed by a strided split; for one row the fused weight read wins.
            w, b = self.gate_up_proj.weight, self.gate_up_proj.bias
            n = self.intermediate
            gate = F.linear(x, w[:n], None if b is None else b[:n])
            up = F.linear(x, w[n:], None if b is None else b[n:])
        return self.down_proj(F.silu(gate) * up)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_index: int, qkv_bias: bool, qk_norm: bool):
        super().__init__()
        self.layer_index = layer_index
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        qkv_bias = qkv_bias or cfg.attention_bias
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, cfg.attention_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        pool: PagedKVPool,
        fb: ForwardBatch,
    ) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        v = qkv[:, self.q_size + self.kv_size :].unflatten(-1, (self.num_kv_heads, self.head_dim))
        if self.q_norm is not None:
            q = qkv[:, : self.q_size].unflatten(-1, (self.num_heads, self.head_dim))
            k = qkv[:, self.q_size : self.q_size + self.kv_size].unflatten(
                -1, (self.num_kv_heads, self.head_dim)
            )
            q = apply_rotary(self.q_norm(q), *cos_sin)
            k = apply_rotary(self.k_norm(k), *cos_sin)
        else:
            # q and k sit side by side in the fused projection: rotate both in one pass.
            qk = qkv[:, : self.q_size + self.kv_size].unflatten(
                -1, (self.num_heads + self.num_kv_heads, self.head_dim)
            )
            qk = apply_rotary(qk, *cos_sin)
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        out = paged_attention(q, k, v, self.layer_index, pool, fb, self.scale)
        return self.o_proj(out)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_index: int, qkv_bias: bool, qk_norm: bool):
        super().__init__()
        self.self_attn = Attention(cfg, layer_index, qkv_bias, qk_norm)
        self.mlp = GatedMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos_sin, pool: PagedKVPool, fb: ForwardBatch) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos_sin, pool, fb)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    """Embedding, decoder layers and final norm: the `model.` prefix of a checkpoint."""

    def __init__(self, cfg: ModelConfig, qkv_bias: bool, qk_norm: bool):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, qkv_bias, qk_norm) for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """A Llama-family causal LM; subclasses only choose the architecture's switches."""

    qkv_bias = False
    qk_norm = False

    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg, self.qkv_bias, self.qk_norm)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, max_positions)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, pool: PagedKVPool, fb: ForwardBatch) -> torch.Tensor:
        """Returns logits (float32) for the rows `fb.logit_rows` of the flat token batch."""
        x = self.model.embed_tokens(input_ids)
        cos_sin = self.rotary.cos_sin(fb.positions, x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos_sin, pool, fb)
        x = self.model.norm(x[fb.logit_rows])
        return self.lm_head(x).float()
