"""Streaming (incremental) detokenization and stop-string helpers.

:class:`IncrementalDetokenizer` turns generated token ids into text deltas one step at a time.
Two things make this harder than ``decode(new_ids)``:

* Byte-level BPE splits one character (an emoji, a CJK ideograph) over several tokens; decoding
  a prefix of them gives U+FFFD. Text is therefore held back while the decoded tail ends with
  U+FFFD, and released once the character is complete.
* Some decoders depend on context (SentencePiece / Metaspace strip the leading space of the
  first token of a decode call), so a token cannot be decoded alone. Like vLLM and SGLang we
  decode a small window: ``ids[prefix_offset:read_offset]`` is text already emitted (context)
  and the delta is ``decode(ids[prefix_offset:])`` minus ``decode(ids[prefix_offset:read_offset])``.
  Each step costs O(window), not O(sequence).

Invariant (without ``prompt_ids``): ``"".join(deltas) + flush() == tokenizer.decode(output_ids)``
with the same ``skip_special_tokens``. With ``prompt_ids`` the last few prompt tokens are used as
context instead, so the first output token keeps the leading space it has after the prompt
(``decode(prompt + output)`` minus ``decode(prompt)``), which is what a completion should show.

:func:`find_stop_string` and :func:`hold_back_len` are the pure helpers a streaming server uses
to cut the text at a stop string without ever emitting the beginning of one.
"""

from __future__ import annotations

from collections.abc import Sequence

from common.engine.tokenizer import Tokenizer

__all__ = ["IncrementalDetokenizer", "find_stop_string", "hold_back_len"]

_REPLACEMENT = "\ufffd"
# Prompt tokens used as decoding context for the first output tokens (vLLM uses 5 as well).
_PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Decode a growing sequence of output ids into text deltas that never split a character.

    ``push(new_ids)`` returns the text that became final with those ids (often ``""`` while a
    multi-token character is incomplete); ``flush()`` returns whatever is still held back at the
    end of the stream. Not thread-safe: one instance per request.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        skip_special_tokens: bool = True,
        prompt_ids: Sequence[int] = (),
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        context = list(prompt_ids[-_PROMPT_CONTEXT_TOKENS:]) if prompt_ids else []
        self._n_context = len(context)
        self._ids: list[int] = context  # context + output ids
        # ids[_prefix:_read] decode to text already emitted (or prompt context);
        # ids[_read:] have not been emitted yet.
        self._prefix = 0
        self._read = len(context)
        self._text_parts: list[str] = []
        self._text_cache: str | None = ""

    @property
    def output_ids(self) -> list[int]:
        """All output ids pushed so far (prompt context excluded)."""
        return self._ids[self._n_context :]

    @property
    def text(self) -> str:
        """All text emitted so far (the concatenation of every returned delta)."""
        if self._text_cache is None:
            self._text_cache = "".join(self._text_parts)
        return self._text_cache

    def push(self, new_ids: Sequence[int]) -> str:
        """Append ``new_ids`` and return the newly complete text (possibly ``""``)."""
        if not new_ids:
            return ""
        self._ids.extend(new_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """Return any held-back text at the end of the stream (may contain U+FFFD if the stream
        really ended inside a character). Further pushes continue normally."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self._read >= len(self._ids):
            return ""
        decode = self._tokenizer.decode
        prefix_text = decode(self._ids[self._prefix : self._read], self._skip)
        full_text = decode(self._ids[self._prefix :], self._skip)
        if not final and full_text.endswith(_REPLACEMENT):
            return ""  # an incomplete character at the end: wait for more bytes
        if full_text.startswith(prefix_text):
            delta = full_text[len(prefix_text) :]
        else:
            # Only when the prompt context ends inside a character: its U+FFFD tail becomes the
            # completed character in full_text. Emit the completed character.
            delta = full_text[len(prefix_text.rstrip(_REPLACEMENT)) :]
        if not delta:
            # Nothing visible yet (e.g. skipped special tokens). Keep the window unchanged so
            # decoders that look at the first token of the window still see the real context.
            return ""
        self._prefix = self._read
        self._read = len(self._ids)
        self._text_parts.append(delta)
        self._text_cache = None
        return delta


def find_stop_string(text: str, stop: Sequence[str], start: int) -> int | None:
    """Index in ``text`` where the earliest stop string begins, or None.

    Only matches that *end* after position ``start`` are considered, i.e. matches that involve
    at least one character of ``text[start:]``. A server calls this after each delta with
    ``start = len(text_before_delta)``: earlier text was already checked, so each call costs
    O(len(delta) + longest stop) instead of O(len(text)). Matches spanning old and new text are
    found because the search begins ``max_len(stop) - 1`` characters before ``start``.

    Among matches, the smallest begin index wins (ties: any stop, same index). Empty stop
    strings are ignored. ``start`` is clamped to ``[0, len(text)]``.
    """
    stops = [s for s in stop if s]
    if not stops:
        return None
    start = min(max(start, 0), len(text))
    longest = max(len(s) for s in stops)
    search_from = max(0, start - longest + 1)
    best: int | None = None
    for s in stops:
        # A match beginning at i ends at i + len(s); it must satisfy i + len(s) > start.
        lo = max(search_from, start - len(s) + 1, 0)
        i = text.find(s, lo)
        if i != -1 and (best is None or i < best):
            best = i
    return best


def hold_back_len(text: str, stop: Sequence[str]) -> int:
    """Number of trailing characters of ``text`` that could be the beginning of a stop string.

    A streaming server must not emit these yet: the next tokens may complete the stop string,
    which is then cut from the output. Returns the length of the longest suffix of ``text`` that
    is a proper prefix of some stop string (0 if none). Complete stop strings are the job of
    :func:`find_stop_string`, so a full match is not counted here. Empty stops are ignored.
    """
    best = 0
    for s in stop:
        # Longest k < len(s) with text ending in s[:k].
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best
