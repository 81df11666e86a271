"""Convert a Llama-architecture GGUF file into a Hugging Face-format model folder.

The folder holds what the engine and the tokenizer layer read:
- `config.json`, rebuilt from the `llama.*` metadata keys;
- `model.safetensors`, float32, with HF tensor names. Quantized tensors are dequantized with
  `gguf.quants.dequantize`, and the rows of the Q and K projections are put back in HF order
  (llama.cpp's converter interleaves each head's two rotary halves for its RoPE kernel);
- `tokenizer.json`, rebuilt with the `tokenizers` library from `tokenizer.ggml.*`, the same way
  transformers' own GGUF tokenizer converter does, plus `tokenizer_config.json` (chat template,
  special tokens) and `generation_config.json`.

Everything is written to a hidden sibling folder first and renamed into place at the end, so a
crash never leaves a half-written model folder behind.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.quants import dequantize
from safetensors.numpy import save_file
from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers, processors
from tokenizers.models import BPE

log = logging.getLogger(__name__)

# GGUF per-layer tensor name -> HF per-layer module name.
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# Tensors llama.cpp adds that have no HF counterpart (rope_freqs: precomputed llama3 frequencies).
_IGNORED = {"rope_freqs.weight"}

# tokenizer.ggml.token_type values
_CONTROL, _USER_DEFINED = 3, 4

# Pre-tokenizer split regexes by `tokenizer.ggml.pre`, as transformers' GGUF converter has them.
# Any other value (including SmolLM2's "smollm") gets the plain GPT-2 byte-level regex.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_SPLITS = {
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "dbrx", "smaug-bpe"),
        _LLAMA3_SPLIT,
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT),
}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table used by byte-level BPE vocabularies."""
    keep = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)}
    keep |= set(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _read_metadata(reader: GGUFReader) -> dict[str, Any]:
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        value = field.contents()
        # float32 metadata (eps, theta) reads as e.g. 9.999999747e-06; keep its shortest spelling.
        if field.types == [GGUFValueType.FLOAT32]:
            value = float(str(np.float32(value)))
        meta[key] = value
    return meta


def _unpermute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's `permute`: per head, rows (half, 2) -> (2, half)."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_name(gguf_name: str) -> str | None:
    base, _, suffix = gguf_name.rpartition(".")
    parts = base.split(".")
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{suffix}"
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{suffix}"
    return None


def _convert_tensors(reader: GGUFReader, n_head: int, n_kv_head: int) -> dict[str, np.ndarray]:
    tensors: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        if t.name in _IGNORED:
            log.warning("skipping GGUF tensor %s (no Hugging Face counterpart)", t.name)
            continue
        name = _hf_name(t.name)
        if name is None:
            raise ValueError(f"unexpected tensor {t.name!r} in a llama GGUF file")
        # GGUF lists dimensions fastest-first; numpy wants them slowest-first.
        shape = tuple(int(d) for d in reversed(t.shape))
        if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            w = np.asarray(t.data, dtype=np.float32)
        else:
            w = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        w = w.reshape(shape)
        if ".attn_q." in t.name:
            w = _unpermute_rope_rows(w, n_head)
        elif ".attn_k." in t.name:
            w = _unpermute_rope_rows(w, n_kv_head)
        tensors[name] = np.ascontiguousarray(w)
    return tensors


def _build_config(meta: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    def key(name: str, default: Any = None) -> Any:
        return meta.get(f"llama.{name}", default)

    hidden, n_head = key("embedding_length"), key("attention.head_count")
    tied = "output.weight" not in tensor_names
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": n_head,
        "num_key_value_heads": key("attention.head_count_kv", n_head),
        "head_dim": key("attention.key_length") or key("rope.dimension_count") or hidden // n_head,
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": key("rope.freq_base", 10000.0),
        "max_position_embeddings": key("context_length"),
        "vocab_size": key("vocab_size") or len(meta["tokenizer.ggml.tokens"]),
        "tie_word_embeddings": tied,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "mlp_bias": "blk.0.ffn_up.bias" in tensor_names,
        "hidden_act": "silu",
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }
    if meta.get("tokenizer.ggml.padding_token_id") is not None:
        config["pad_token_id"] = meta["tokenizer.ggml.padding_token_id"]
    rope_type = key("rope.scaling.type")
    if rope_type and rope_type != "none":
        scaling: dict[str, Any] = {"rope_type": rope_type}
        scaling["factor"] = key("rope.scaling.factor", 1.0)
        if orig := key("rope.scaling.original_context_length"):
            scaling["original_max_position_embeddings"] = orig
        config["rope_scaling"] = scaling
    return config


def _build_tokenizer(meta: dict[str, Any]) -> Tokenizer:
    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"only byte-level BPE ('gpt2') GGUF tokenizers are supported: {model!r}")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())

    def spell(token: str) -> str:  # a token outside the byte alphabet is spelled out bytewise
        return token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode())

    vocab = {spell(tok): i for i, tok in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    tok = Tokenizer(
        BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    split = _PRE_SPLITS.get(meta.get("tokenizer.ggml.pre", ""))
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tok.decoder = decoders.ByteLevel()
    # Control tokens are special; a "control" token outside the byte alphabet is a llama.cpp
    # mislabel and is left alone, as transformers does.
    tok.add_special_tokens(
        [
            AddedToken(t, normalized=False, special=True)
            for t, kind in zip(tokens, types, strict=True)
            if kind == _CONTROL and set(t) <= alphabet
        ]
    )
    tok.add_tokens(
        [
            AddedToken(t, normalized=False, special=False)
            for t, kind in zip(tokens, types, strict=True)
            if kind == _USER_DEFINED and t in vocab
        ]
    )
    tok.post_processor = _post_processor(meta, tokens)
    return tok


def _post_processor(meta: dict[str, Any], tokens: list[str]) -> processors.TemplateProcessing:
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    eos_id = meta.get("tokenizer.ggml.eos_token_id")
    prefix, suffix, special = [], [], []
    if meta.get("tokenizer.ggml.add_bos_token") and bos_id is not None:
        prefix, special = [tokens[bos_id]], [(tokens[bos_id], bos_id)]
    if meta.get("tokenizer.ggml.add_eos_token") and eos_id is not None:
        suffix = [tokens[eos_id]]
        special.append((tokens[eos_id], eos_id))
    single = [*prefix, "$A:0", *suffix]
    pair = [*single, *prefix, "$B:1", *suffix]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


def _tokenizer_config(meta: dict[str, Any]) -> dict[str, Any]:
    tokens = meta["tokenizer.ggml.tokens"]

    def token(key: str) -> str | None:
        idx = meta.get(f"tokenizer.ggml.{key}")
        return tokens[idx] if idx is not None else None

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id"),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "model_max_length": meta.get("llama.context_length"),
        "clean_up_tokenization_spaces": False,
    }
    if meta.get("tokenizer.chat_template"):
        config["chat_template"] = meta["tokenizer.chat_template"]
    return {k: v for k, v in config.items() if v is not None}


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def convert_gguf_to_hf(gguf_path: Path, out_dir: Path) -> Path:
    """Convert a llama GGUF file into an HF folder at `out_dir` (replaced if present)."""
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    reader = GGUFReader(gguf_path)
    meta = _read_metadata(reader)
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"{gguf_path}: GGUF architecture {arch!r} is not supported (only 'llama')")
    tensor_names = {t.name for t in reader.tensors}
    config = _build_config(meta, tensor_names)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        tensors = _convert_tensors(
            reader, config["num_attention_heads"], config["num_key_value_heads"]
        )
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        os.chmod(tmp / "model.safetensors", 0o644)  # safetensors creates it owner-only
        del tensors
        _write_json(tmp / "config.json", config)
        generation = {
            k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config
        }
        _write_json(tmp / "generation_config.json", generation)
        _build_tokenizer(meta).save(str(tmp / "tokenizer.json"))
        _write_json(tmp / "tokenizer_config.json", _tokenizer_config(meta))
        _swap_into_place(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("converted %s -> %s", gguf_path, out_dir)
    return out_dir


def _swap_into_place(tmp: Path, out_dir: Path) -> None:
    """Rename `tmp` to `out_dir`; an existing `out_dir` is moved aside first, then deleted."""
    old = None
    if out_dir.exists():
        old = out_dir.parent / f".{out_dir.name}.old-{uuid.uuid4().hex[:8]}"
        os.rename(out_dir, old)
    os.rename(tmp, out_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
