"""Tiny, deterministic model folders for the test suite, built in-process (no model hub).

* :func:`build_tokenizer` trains a byte-level BPE tokenizer (380 tokens: 3 specials, the 256
  byte symbols and 121 merges) on a small built-in corpus and writes ``tokenizer.json`` plus a
  ``tokenizer_config.json`` carrying a ChatML chat template.
* :func:`build_tiny_checkpoint` writes a randomly initialised 2-layer Llama / Qwen2 / Qwen3 /
  Mistral checkpoint (float32 safetensors, ``config.json``, ``generation_config.json``) next to
  those tokenizer files, so the folder looks exactly like a Hugging Face model download.

Special token ids: ``<|endoftext|>`` = 0, ``<|im_start|>`` = 1, ``<|im_end|>`` = 2 (the EOS).
The model vocab (384) is a little larger than the tokenizer's (380), as in real checkpoints
whose embedding matrix is padded; ids 380..383 never come out of the tokenizer.

transformers is used here only to write checkpoints (and as a test oracle elsewhere); the
runtime packages never import it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOKENIZER_VOCAB_SIZE = 380
MODEL_VOCAB_SIZE = 384
EOS_TOKEN = "<|im_end|>"
EOS_TOKEN_ID = 2
ARCHS = ("llama", "qwen2", "qwen3", "mistral")

# ChatML, as in SmolLM2 / Qwen (without SmolLM2's default system prompt).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

LLAMA3_ROPE_SCALING: dict[str, Any] = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}

_CORPUS = """\
The quick brown fox jumps over the lazy dog. The dog was not amused, and the fox ran away.
Once upon a time, in a small village by the sea, there lived an old fisherman and his wife.
Every morning he went out to catch fish, and every evening he came home tired but happy.
Hello, world! Hello there. How are you today? I am fine, thank you. What is your name?
The capital of France is Paris. The capital of Germany is Berlin. The capital of Japan is Tokyo.
Large language models predict the next token given all of the previous tokens in the sequence.
A prefill server computes the key-value cache for the prompt; a decode server generates tokens.
Serving systems batch many requests together so that the accelerator stays busy all the time.
She said: "It's a beautiful day, isn't it?" He replied, 'Yes -- the sun is shining again.'
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 42 100 256 1024 2048 4096 65536 3.14159 2.71828 -7 1e-6
Dates and times: 2024-01-31, 12:30:45, 1999/12/31 23:59:59, Monday, Tuesday, Wednesday.
Prices: $9.99, €15.00, £3.50, ¥1000; percentages: 50%, 99.9%, 0.01%.
def fibonacci(n: int) -> int:
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)

for i in range(10):
    print(f"{i}: {fibonacci(i)}")

class Cache:
    def __init__(self, size):
        self.size = size
        self.blocks = [None] * size

    def get(self, key):
        return self.blocks[hash(key) % self.size]

import json
data = {"name": "pdserve", "version": "0.1.0", "tags": ["llm", "serving"], "ok": true}
print(json.dumps(data, indent=2))
int main(void) { printf("hello\\n"); return 0; }
SELECT id, name FROM users WHERE age > 21 ORDER BY name;
<html><body><p>Hello &amp; welcome</p></body></html>
你好，世界！今天天气很好。我们一起去公园散步吧。
中文是一种美丽的语言。学习语言需要时间和耐心。
こんにちは、世界。日本語のテキストです。ありがとうございます。
안녕하세요, 세계! 한국어 문장입니다.
Привет, мир! Как дела? Всё хорошо.
Emoji: 😀 😃 😄 😁 😆 🎉 🎊 👋 👋🏽 👍 ❤️ 🔥 ✨ 🚀 🌍 🙂 🤖 🐍
Mixed: I love 🍕 and 🍣! 这是 a mixed 句子 with émojis 🎉 and accents: café, naïve, résumé.
Whitespace:	tabs	and  double  spaces   and
new lines.

The end. The end. The end.
"""


def corpus_lines() -> list[str]:
    """The built-in training corpus, one string per line (repeated a few times for counts)."""
    lines = _CORPUS.splitlines(keepends=True)
    return lines * 3


def build_tokenizer(dir: Path) -> None:
    """Train the byte-level BPE tokenizer and write ``tokenizer.json`` + ``tokenizer_config.json``.

    Deterministic: the same corpus and settings always give byte-identical files.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    dir = Path(dir)
    dir.mkdir(parents=True, exist_ok=True)

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_lines(), trainer=trainer)

    size = tok.get_vocab_size(with_added_tokens=True)
    if size != TOKENIZER_VOCAB_SIZE:
        raise RuntimeError(f"tiny tokenizer has {size} tokens, expected {TOKENIZER_VOCAB_SIZE}")
    for i, token in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(token) == i, (token, tok.token_to_id(token))

    tok.save(str(dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 512,
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {
            str(i): {
                "content": token,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for i, token in enumerate(SPECIAL_TOKENS)
        },
    }
    (dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))


def build_tiny_checkpoint(dir: Path, arch: str, rope_scaling: dict[str, Any] | None = None) -> Path:
    """Write a random 2-layer ``arch`` checkpoint (float32 safetensors) plus tokenizer files.

    ``arch`` is one of ``llama``, ``qwen2``, ``qwen3``, ``mistral``. ``rope_scaling`` (Llama
    only) e.g. :data:`LLAMA3_ROPE_SCALING` builds a Llama-3-style scaled-RoPE checkpoint.
    Returns ``dir``.
    """
    import torch
    import transformers

    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")
    if rope_scaling is not None and arch != "llama":
        raise ValueError("rope_scaling is only supported for the llama tiny checkpoint")

    dir = Path(dir)
    dir.mkdir(parents=True, exist_ok=True)

    common: dict[str, Any] = {
        "vocab_size": MODEL_VOCAB_SIZE,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 512,
        "initializer_range": 0.2,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "bos_token_id": None,
        "eos_token_id": EOS_TOKEN_ID,
        "pad_token_id": None,
        "tie_word_embeddings": arch in ("llama", "qwen3"),
    }
    if arch == "llama":
        if rope_scaling is not None:
            common["rope_scaling"] = dict(rope_scaling)
        config = transformers.LlamaConfig(**common)
        model_cls = transformers.LlamaForCausalLM
    elif arch == "qwen2":
        config = transformers.Qwen2Config(**common)
        model_cls = transformers.Qwen2ForCausalLM
    elif arch == "qwen3":
        config = transformers.Qwen3Config(**common)
        model_cls = transformers.Qwen3ForCausalLM
    else:
        # No sliding window: with 512 positions a 4096 window would be a no-op anyway.
        config = transformers.MistralConfig(**common, sliding_window=None)
        model_cls = transformers.MistralForCausalLM

    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(0)
    model = model_cls(config).to(torch.float32).eval()
    model.save_pretrained(dir, safe_serialization=True)
    build_tokenizer(dir)
    return dir
