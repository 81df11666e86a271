"""common.engine.tokenizer.Tokenizer against transformers (the test-only oracle)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from common.engine.tokenizer import ChatTemplateError, Tokenizer

transformers = pytest.importorskip("transformers")

TEXTS = [
    "",
    "Hello, world!",
    "The capital of France is Paris.",
    "  leading and trailing spaces  ",
    "tabs\tand\nnew\n\nlines",
    "def f(x):\n    return x * 2  # comment",
    "Numbers 0123456789 and 3.14159, 1e-6",
    "你好，世界！",
    "こんにちは 안녕하세요 Привет",
    "👋🏽🎉 emoji 🦙 and ZWJ 👨‍👩‍👧",
    "café naïve résumé",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "text with a special<|im_end|>inside",
    "\u0000\u0001 control chars \x7f",
]

CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hello!"}],
    [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is 2 + 2?"},
    ],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "你好 👋"},
        {"role": "assistant", "content": "Hi there!"},
        {"role": "user", "content": "Tell me a joke."},
    ],
]


@pytest.fixture(scope="module")
def tok(tiny_tokenizer_dir: Path) -> Tokenizer:
    return Tokenizer.from_model_path(tiny_tokenizer_dir)


@pytest.fixture(scope="module")
def hf_tok(tiny_tokenizer_dir: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir))


def _copy_with_config(src: Path, dst: Path, **updates: Any) -> Path:
    """Copy a tokenizer folder and update (or, for value None, delete) tokenizer_config keys."""
    shutil.copytree(src, dst)
    cfg_path = dst / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    for key, value in updates.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    cfg_path.write_text(json.dumps(cfg))
    return dst


# --------------------------------------------------------------------------- encode / decode


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_matches_transformers(
    tok: Tokenizer, hf_tok: Any, text: str, add_special_tokens: bool
) -> None:
    expected = hf_tok.encode(text, add_special_tokens=add_special_tokens)
    assert tok.encode(text, add_special_tokens=add_special_tokens) == expected


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("skip", [True, False])
def test_decode_matches_transformers(tok: Tokenizer, hf_tok: Any, text: str, skip: bool) -> None:
    ids = hf_tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=skip) == hf_tok.decode(ids, skip_special_tokens=skip)
    if not skip:
        assert tok.decode(ids, skip_special_tokens=False) == text


def test_decode_ignores_out_of_vocab_ids(tok: Tokenizer) -> None:
    # The tiny model's vocab (384) is larger than the tokenizer's (380).
    ids = tok.encode("hi")
    assert tok.decode([*ids, 381, 383]) == "hi"


def test_vocab_and_special_ids(tok: Tokenizer, hf_tok: Any) -> None:
    assert tok.vocab_size == 380 == len(hf_tok)
    assert tok.eos_token_ids == frozenset({hf_tok.eos_token_id}) == frozenset({2})
    assert tok.eos_token == "<|im_end|>"
    assert tok.bos_token_id is None and tok.bos_token is None
    assert tok.special_token_ids == frozenset(hf_tok.all_special_ids) | {1}
    assert tok.special_token_ids == frozenset({0, 1, 2})


def test_convert_ids_to_tokens(tok: Tokenizer, hf_tok: Any) -> None:
    ids = hf_tok.encode("Hello world 你好<|im_end|>", add_special_tokens=False)
    assert tok.convert_ids_to_tokens(ids) == hf_tok.convert_ids_to_tokens(ids)
    assert tok.convert_ids_to_tokens([383]) == [""]


def test_missing_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_model_path(tmp_path)


def test_eos_ids_union_of_configs(tiny_tokenizer_dir: Path, tmp_path: Path) -> None:
    d = _copy_with_config(tiny_tokenizer_dir, tmp_path / "m")
    (d / "config.json").write_text(json.dumps({"eos_token_id": [2, 5], "bos_token_id": 0}))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    t = Tokenizer.from_model_path(d)
    assert t.eos_token_ids == frozenset({2, 5, 7})
    assert t.bos_token_id == 0
    assert {2, 5, 7} <= t.special_token_ids


def test_checkpoint_folder_eos(tiny_model_dir: Path) -> None:
    """Every tiny checkpoint folder (all archs) loads, with EOS from config + tokenizer."""
    t = Tokenizer.from_model_path(tiny_model_dir)
    assert json.loads((tiny_model_dir / "config.json").read_text())["eos_token_id"] == 2
    assert t.eos_token_ids == frozenset({2})
    assert t.bos_token_id is None
    assert t.vocab_size == 380


@pytest.mark.parametrize("tiny_model_dir", ["qwen3"], indirect=True)
def test_tiny_model_dir_indirect(tiny_model_dir: Path, tiny_qwen3_dir: Path) -> None:
    assert tiny_model_dir == tiny_qwen3_dir


def test_llama3_rope_fixture(tiny_llama3_rope_dir: Path) -> None:
    cfg = json.loads((tiny_llama3_rope_dir / "config.json").read_text())
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling")
    assert rope["rope_type"] == "llama3" and rope["factor"] == 8.0


def test_added_token_dict_and_add_bos(tiny_tokenizer_dir: Path, tmp_path: Path) -> None:
    d = _copy_with_config(
        tiny_tokenizer_dir,
        tmp_path / "m",
        eos_token={"content": "<|endoftext|>", "special": True},
        bos_token={"content": "<|im_start|>"},
        add_bos_token=True,
    )
    t = Tokenizer.from_model_path(d)
    assert t.eos_token_ids == frozenset({0})
    assert t.bos_token_id == 1
    ids = t.encode("hi")
    assert ids[0] == 1 and ids[1:] == t.encode("hi", add_special_tokens=False)


# --------------------------------------------------------------------------- chat templates


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    tok: Tokenizer, hf_tok: Any, messages: list[dict[str, Any]], add_generation_prompt: bool
) -> None:
    expected = hf_tok.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    got = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert got == expected
    assert tok.has_chat_template
    hf_ids = hf_tok.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=add_generation_prompt
    )
    if not isinstance(hf_ids, list):  # transformers 5 returns a BatchEncoding by default
        hf_ids = hf_ids["input_ids"]
    assert tok.encode(got, add_special_tokens=False) == hf_ids


def test_chat_template_exact_text(tok: Tokenizer) -> None:
    got = tok.apply_chat_template(
        [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    )
    assert got == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
    )


# A template exercising the HF jinja extras: tojson (non-ASCII, HTML chars, indent), loop
# controls, trim/lstrip blocks, the {% generation %} tag, bos/eos variables and extra kwargs.
FANCY_TEMPLATE = """\
{{ bos_token }}{% if tools %}
Tools: {{ tools | tojson }}
Indented: {{ tools[0] | tojson(indent=2) }}
{% endif %}
{% for m in messages %}
    {% if m['role'] == 'skip' %}{% continue %}{% endif %}
    {% if m['role'] == 'assistant' %}
<{{ m['role'] }}>{% generation %}{{ m['content'] }}{% endgeneration %}{{ eos_token }}
    {% else %}
<{{ m['role'] }}>{{ m['content'] }}
    {% endif %}
{% endfor %}
{% if custom_flag is defined and custom_flag %}FLAG{% endif %}
{% if add_generation_prompt %}<assistant>{% endif %}"""


def test_fancy_template_matches_transformers(tiny_tokenizer_dir: Path, tmp_path: Path) -> None:
    d = _copy_with_config(
        tiny_tokenizer_dir, tmp_path / "m", chat_template=FANCY_TEMPLATE, bos_token="<|endoftext|>"
    )
    tools = [{"name": "get_weather", "description": "天气 <b>&'\"", "parameters": {"a": 1}}]
    messages = [
        {"role": "user", "content": "Hi é"},
        {"role": "skip", "content": "ignored"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Bye", "name": None},
    ]
    hf = transformers.AutoTokenizer.from_pretrained(str(d))
    ours = Tokenizer.from_model_path(d)
    for agp in (True, False):
        kwargs = {"tools": tools, "custom_flag": True}
        expected = hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=agp, **kwargs
        )
        assert ours.apply_chat_template(messages, add_generation_prompt=agp, **kwargs) == expected
    assert "天气 <b>&'" in ours.apply_chat_template(messages, tools=tools)


def test_strftime_now(tiny_tokenizer_dir: Path, tmp_path: Path) -> None:
    d = _copy_with_config(
        tiny_tokenizer_dir, tmp_path / "m", chat_template="{{ strftime_now('%Y') }}"
    )
    out = Tokenizer.from_model_path(d).apply_chat_template([{"role": "user", "content": "x"}])
    assert out.isdigit() and len(out) == 4


def test_raise_exception_becomes_chat_template_error(
    tiny_tokenizer_dir: Path, tmp_path: Path
) -> None:
    template = (
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not "
        "supported') }}{% endif %}{{ messages[0]['content'] }}"
    )
    d = _copy_with_config(tiny_tokenizer_dir, tmp_path / "m", chat_template=template)
    t = Tokenizer.from_model_path(d)
    assert t.apply_chat_template([{"role": "user", "content": "ok"}]) == "ok"
    with pytest.raises(ChatTemplateError, match="System role not supported"):
        t.apply_chat_template([{"role": "system", "content": "x"}])
    # transformers raises too (a jinja TemplateError).
    hf = transformers.AutoTokenizer.from_pretrained(str(d))
    with pytest.raises(Exception, match="System role not supported"):
        hf.apply_chat_template([{"role": "system", "content": "x"}], tokenize=False)
    assert issubclass(ChatTemplateError, ValueError)


def test_template_syntax_and_runtime_errors(tiny_tokenizer_dir: Path, tmp_path: Path) -> None:
    bad = _copy_with_config(tiny_tokenizer_dir, tmp_path / "a", chat_template="{% for %}")
    with pytest.raises(ChatTemplateError, match="compile"):
        Tokenizer.from_model_path(bad).apply_chat_template([{"role": "user", "content": "x"}])
    typ = _copy_with_config(
        tiny_tokenizer_dir, tmp_path / "b", chat_template="{{ messages[0]['content'] + 1 }}"
    )
    with pytest.raises(ChatTemplateError):
        Tokenizer.from_model_path(typ).apply_chat_template([{"role": "user", "content": "x"}])


def test_missing_chat_template(tiny_tokenizer_dir: Path, tmp_path: Path) -> None:
    d = _copy_with_config(tiny_tokenizer_dir, tmp_path / "m", chat_template=None)
    t = Tokenizer.from_model_path(d)
    assert not t.has_chat_template
    with pytest.raises(ChatTemplateError, match="no chat template"):
        t.apply_chat_template([{"role": "user", "content": "hi"}])


def test_chat_template_jinja_file_takes_precedence(
    tiny_tokenizer_dir: Path, tmp_path: Path
) -> None:
    d = _copy_with_config(tiny_tokenizer_dir, tmp_path / "m")
    (d / "chat_template.jinja").write_text("JINJA:{{ messages[0]['content'] }}")
    t = Tokenizer.from_model_path(d)
    assert t.apply_chat_template([{"role": "user", "content": "x"}]) == "JINJA:x"
    hf = transformers.AutoTokenizer.from_pretrained(str(d))
    assert hf.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False) == "JINJA:x"


def test_named_template_list(tiny_tokenizer_dir: Path, tmp_path: Path) -> None:
    templates = [
        {"name": "tool_use", "template": "TOOLS:{{ tools | length }}"},
        {"name": "default", "template": "DEFAULT:{{ messages | length }}"},
    ]
    d = _copy_with_config(tiny_tokenizer_dir, tmp_path / "m", chat_template=templates)
    t = Tokenizer.from_model_path(d)
    msgs = [{"role": "user", "content": "x"}]
    assert t.apply_chat_template(msgs) == "DEFAULT:1"
    assert t.apply_chat_template(msgs, tools=[{"name": "f"}]) == "TOOLS:1"


def test_content_parts_flattened(tok: Tokenizer) -> None:
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]
    flat = tok.apply_chat_template([{"role": "user", "content": parts}])
    assert flat == tok.apply_chat_template([{"role": "user", "content": "Hello\nworld"}])
    single = tok.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": "x"}]}])
    assert single == tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_non_text_content_part_rejected(tok: Tokenizer) -> None:
    parts = [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": "data:..."}},
    ]
    with pytest.raises(ChatTemplateError, match="image_url"):
        tok.apply_chat_template([{"role": "user", "content": parts}])


def test_bad_messages_rejected(tok: Tokenizer) -> None:
    with pytest.raises(ChatTemplateError):
        tok.apply_chat_template(["not a dict"])  # type: ignore[list-item]


def test_runtime_modules_do_not_import_transformers() -> None:
    code = (
        "import sys, common.engine.tokenizer, common.engine.detokenizer; "
        "assert 'transformers' not in sys.modules, 'transformers imported'"
    )
    root = Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)
