"""IncrementalDetokenizer streaming correctness, and the stop-string helpers."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors

from common.engine.detokenizer import IncrementalDetokenizer, find_stop_string, hold_back_len
from common.engine.tokenizer import Tokenizer

STREAM_TEXTS = [
    "👋🏽🎉",
    "你好，世界",
    "Hello 你好 👋 world! café 🦙🦙 done.",
    "def f(x):\n    return '🐍'  # 中文\n",
    "👨‍👩‍👧 family, 🇫🇷 flag, ❤️ heart",
    "<|im_start|>assistant\n答案是 42 🎉<|im_end|>",
    "a<|im_end|><|im_end|>b<|endoftext|>🎉<|im_start|>",
]


@pytest.fixture(scope="module")
def tok(tiny_tokenizer_dir: Path) -> Tokenizer:
    return Tokenizer.from_model_path(tiny_tokenizer_dir)


def stream(
    tokenizer: Tokenizer,
    ids: Sequence[int],
    skip: bool = True,
    chunk: int = 1,
    prompt_ids: Sequence[int] = (),
) -> tuple[list[str], str]:
    """Push ``ids`` ``chunk`` at a time; return (deltas, flush text)."""
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip, prompt_ids=prompt_ids)
    deltas = [detok.push(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    tail = detok.flush()
    assert detok.text == "".join(deltas) + tail
    assert detok.output_ids == list(ids)
    return deltas, tail


# --------------------------------------------------------------------------- byte-level BPE


@pytest.mark.parametrize("text", STREAM_TEXTS)
@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_stream_never_emits_replacement_char(
    tok: Tokenizer, text: str, skip: bool, chunk: int
) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    deltas, tail = stream(tok, ids, skip=skip, chunk=chunk)
    for d in deltas:
        assert "\ufffd" not in d
    assert tail == ""  # valid UTF-8 input: nothing left over
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)
    if not skip:
        assert "".join(deltas) == text


def test_emoji_split_across_tokens_is_held_back(tok: Tokenizer) -> None:
    ids = tok.encode("🦙", add_special_tokens=False)
    assert len(ids) >= 2, "the test needs an emoji that the tiny tokenizer splits"
    assert tok.decode(ids[:1]).endswith("\ufffd")  # what a naive streamer would print
    deltas, tail = stream(tok, ids)
    assert deltas == [""] * (len(ids) - 1) + ["🦙"]
    assert tail == ""


def test_text_then_emoji_deltas(tok: Tokenizer) -> None:
    ids = tok.encode("ok 🦙!", add_special_tokens=False)
    deltas, _ = stream(tok, ids)
    assert any("🦙" in d for d in deltas)  # the emoji comes out whole, in one delta
    assert "".join(deltas) == "ok 🦙!"


def test_flush_releases_broken_tail(tok: Tokenizer) -> None:
    ids = tok.encode("hi 🦙", add_special_tokens=False)[:-1]  # stream ends mid-emoji
    deltas, tail = stream(tok, ids)
    assert "\ufffd" not in "".join(deltas)
    assert tail.endswith("\ufffd")
    assert "".join(deltas) + tail == tok.decode(ids)


def test_skipped_special_tokens_only(tok: Tokenizer) -> None:
    deltas, tail = stream(tok, [2, 0, 1, 2])
    assert deltas == ["", "", "", ""] and tail == ""
    deltas, tail = stream(tok, [2, 0], skip=False)
    assert deltas == ["<|im_end|>", "<|endoftext|>"]


def test_prompt_context(tok: Tokenizer) -> None:
    prompt = tok.encode("The capital of France is", add_special_tokens=False)
    out = tok.encode(" Paris 🎉", add_special_tokens=False)
    deltas, tail = stream(tok, out, prompt_ids=prompt)
    assert "".join(deltas) + tail == " Paris 🎉"


def test_prompt_ending_mid_character(tok: Tokenizer) -> None:
    ids = tok.encode("a 🦙 b", add_special_tokens=False)
    emoji_start = next(i for i in range(len(ids)) if tok.decode(ids[: i + 1]).endswith("\ufffd"))
    prompt, out = ids[: emoji_start + 1], ids[emoji_start + 1 :]
    deltas, tail = stream(tok, out, prompt_ids=prompt)
    assert "".join(deltas) + tail == "🦙 b"  # the completed character is emitted whole


@pytest.mark.parametrize("seed", range(20))
def test_random_ids_invariant(tok: Tokenizer, seed: int) -> None:
    """Arbitrary ids (broken UTF-8, specials, out-of-vocab): deltas + flush == decode(ids)."""
    rng = random.Random(seed)
    ids = [rng.randrange(384) for _ in range(rng.randrange(1, 60))]
    chunk = rng.choice([1, 1, 2, 5])
    for skip in (True, False):
        deltas, tail = stream(tok, ids, skip=skip, chunk=chunk)
        assert "".join(deltas) + tail == tok.decode(ids, skip_special_tokens=skip)


def test_push_empty_and_flush_twice(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok)
    assert detok.push([]) == ""
    assert detok.flush() == ""
    ids = tok.encode("hey", add_special_tokens=False)
    assert "".join(detok.push([i]) for i in ids) == "hey"
    assert detok.flush() == "" and detok.flush() == ""
    assert detok.text == "hey"


# --------------------------------------------------------------------------- SentencePiece-style


def _sentencepiece_tokenizer(style: str) -> Tokenizer:
    """A tiny Llama-2-style (``strip``) or Metaspace-style tokenizer with byte fallback."""
    words = ["▁Hello", "▁world", "▁Paris", "▁is", "▁The", "▁capital", "!"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    merges: list[tuple[str, str]] = []
    for w in words:
        for ch in w:
            vocab.setdefault(ch, len(vocab))
        cur = w[0]
        for ch in w[1:]:
            if (cur, ch) not in merges:
                merges.append((cur, ch))
            cur += ch
            vocab.setdefault(cur, len(vocab))
    model = models.BPE(
        vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True
    )
    hf = HFTokenizer(model)
    if style == "strip":
        hf.normalizer = normalizers.Sequence(
            [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
        )
        hf.decoder = decoders.Sequence(
            [
                decoders.Replace("▁", " "),
                decoders.ByteFallback(),
                decoders.Fuse(),
                decoders.Strip(" ", 1, 0),
            ]
        )
    else:
        hf.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        hf.decoder = decoders.Sequence(
            [decoders.ByteFallback(), decoders.Metaspace(replacement="▁", prepend_scheme="first")]
        )
    hf.add_special_tokens(["<s>", "</s>"])
    hf.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return Tokenizer(
        hf, special_tokens={"bos_token": "<s>", "eos_token": "</s>"}, add_bos_token=True
    )


@pytest.mark.parametrize("style", ["strip", "metaspace"])
def test_sentencepiece_spaces_mid_stream(style: str) -> None:
    sp = _sentencepiece_tokenizer(style)
    ids = sp.encode("Hello world! 你好 Paris")
    assert ids[0] == sp.bos_token_id == 1 and ids.count(1) == 1  # BOS from post-processor once
    for skip in (True, False):
        deltas, tail = stream(sp, ids, skip=skip)
        assert "\ufffd" not in "".join(deltas) and tail == ""
        assert "".join(deltas) == sp.decode(ids, skip_special_tokens=skip)
    deltas, _ = stream(sp, ids)
    words = [d for d in deltas if d]
    # Decoding each token alone would lose the spaces: " world" must keep its space.
    assert words[:3] == ["Hello", " world", "!"]
    assert "".join(words) == "Hello world! 你好 Paris"


@pytest.mark.parametrize("style", ["strip", "metaspace"])
def test_sentencepiece_prompt_context_keeps_leading_space(style: str) -> None:
    sp = _sentencepiece_tokenizer(style)
    prompt = sp.encode("The capital is")
    full = sp.encode("The capital is Paris!")
    out = full[len(prompt) :]
    assert sp.decode(out) == "Paris!"  # a standalone decode strips the space...
    deltas, tail = stream(sp, out, prompt_ids=prompt)
    assert "".join(deltas) + tail == " Paris!"  # ...the context window keeps it


@pytest.mark.parametrize("style", ["strip", "metaspace"])
def test_sentencepiece_skipped_eos_mid_stream(style: str) -> None:
    sp = _sentencepiece_tokenizer(style)
    a = sp.encode("Hello", add_special_tokens=False)
    b = sp.encode("Hello world", add_special_tokens=False)[len(a) :]
    ids = [*a, 2, *b]
    deltas, tail = stream(sp, ids)
    assert "".join(deltas) + tail == sp.decode(ids) == "Hello world"


# --------------------------------------------------------------------------- stop strings


def test_find_stop_string_basic() -> None:
    assert find_stop_string("hello world", ["world"], 0) == 6
    assert find_stop_string("hello world", ["xyz"], 0) is None
    assert find_stop_string("hello", [], 0) is None
    assert find_stop_string("hello", [""], 0) is None


def test_find_stop_string_at_start() -> None:
    assert find_stop_string("STOP here", ["STOP"], 0) == 0
    assert find_stop_string("STOP", ["STOP"], 3) == 0  # last char is new


def test_find_stop_string_multiple_picks_earliest() -> None:
    text = "abc END xyz STOP"
    assert find_stop_string(text, ["STOP", "END"], 0) == 4
    assert find_stop_string(text, ["END", "STOP"], 0) == 4
    assert find_stop_string("ab", ["b", "ab"], 0) == 0


def test_find_stop_string_overlapping() -> None:
    assert find_stop_string("aaab", ["aab"], 0) == 1
    assert find_stop_string("xabab", ["abab", "bab"], 0) == 1


def test_find_stop_string_spanning_old_and_new_text() -> None:
    # "Hello wor" was already checked; "ld!" is new; the stop spans both.
    assert find_stop_string("Hello world!", ["world"], len("Hello wor")) == 6
    # Entirely inside old text: already reported earlier, not searched again.
    assert find_stop_string("world and more", ["world"], len("world and")) is None
    # Ends exactly at the first new character.
    assert find_stop_string("xxSTOP", ["STOP"], 5) == 2
    # start beyond / before the text is clamped.
    assert find_stop_string("abc", ["c"], 99) is None
    assert find_stop_string("abc", ["a"], -5) == 0


def test_find_stop_string_incremental_equals_full_scan() -> None:
    rng = random.Random(1)
    stops = ["ab", "bca", "cc"]
    for _ in range(200):
        text = "".join(rng.choice("abc") for _ in range(rng.randrange(0, 20)))
        expected = min((i for s in stops if (i := text.find(s)) != -1), default=None)
        found, pos = None, 0
        while found is None and pos < len(text):
            step = rng.randrange(1, 4)
            found = find_stop_string(text[: pos + step], stops, pos)
            pos += step
        assert found == expected, (text, found, expected)


def test_hold_back_len() -> None:
    assert hold_back_len("hello", ["</s>"]) == 0
    assert hold_back_len("hello <", ["</s>"]) == 1
    assert hold_back_len("hello </", ["</s>"]) == 2
    assert hold_back_len("hello </s", ["</s>"]) == 3
    assert hold_back_len("hello </s>", ["</s>"]) == 0  # a full match is find_stop_string's job
    assert hold_back_len("ab", ["bx", "abx"]) == 2  # longest candidate wins
    assert hold_back_len("aa", ["aab"]) == 2
    assert hold_back_len("", ["x"]) == 0
    assert hold_back_len("x", ["", "y"]) == 0
    assert hold_back_len("a", ["a"]) == 0
    assert hold_back_len("ST", ["STOP"]) == 2
