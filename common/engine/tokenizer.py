"""Tokenizer and chat-template rendering for a Hugging Face-format model folder.

:class:`Tokenizer` wraps a fast ``tokenizers.Tokenizer`` (``tokenizer.json``) and reads the
metadata that lives next to it:

* ``tokenizer_config.json``: ``chat_template`` (a string, or a list of ``{name, template}``
  dicts), ``bos_token`` / ``eos_token`` / ``pad_token`` / ``unk_token`` (a string or an
  AddedToken-style dict with ``content``), ``add_bos_token``;
* ``chat_template.jinja``: a standalone template (transformers 5 writes this); it takes
  precedence over the one in ``tokenizer_config.json``;
* ``config.json`` and ``generation_config.json``: ``eos_token_id`` (int or list) and
  ``bos_token_id``.

Chat templates are rendered with jinja2 configured the way transformers configures it
(sandboxed, ``trim_blocks``/``lstrip_blocks``, ``loopcontrols``, ``raise_exception``,
``strftime_now``, an HF-compatible ``tojson`` filter and a no-op ``{% generation %}`` tag), so
that a template from the Hub renders the same text here as with ``transformers``.

This module must never import ``transformers``; it is runtime code.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, ClassVar

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer

__all__ = ["ChatTemplateError", "Tokenizer"]

_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


class ChatTemplateError(ValueError):
    """The chat template is missing, malformed, rejected the messages, or failed to render."""


# --------------------------------------------------------------------------- jinja setup


class _GenerationTag(jinja2.ext.Extension):
    """Accept transformers' ``{% generation %}...{% endgeneration %}`` blocks and render the body.

    transformers uses the tag to compute assistant-token masks; for serving it is a no-op, but
    templates that contain it must still compile.
    """

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Like transformers' override: no HTML escaping (jinja's builtin escapes <, >, &, ').
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _make_jinja_env() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


_JINJA_ENV = _make_jinja_env()


# --------------------------------------------------------------------------- config helpers


def _read_json(path: Path) -> dict[str, Any]:
    """Return the JSON object in ``path``, or ``{}`` if the file does not exist."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot parse {path}: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(  # noqa: TRY004 - a bad config file, not a bad argument
            f"{path} must contain a JSON object, got {type(data).__name__}"
        )
    return data


def _token_content(value: Any) -> str | None:
    """A special token from tokenizer_config.json: a string or ``{"content": ...}``."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _int_ids(value: Any) -> list[int]:
    """An ``eos_token_id``-style field: an int, a list of ints, or absent."""
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _model_config_field(config: Mapping[str, Any], key: str) -> Any:
    """``config[key]``, falling back to a nested ``text_config`` (multimodal checkpoints)."""
    if config.get(key) is not None:
        return config[key]
    text_config = config.get("text_config")
    if isinstance(text_config, Mapping):
        return text_config.get(key)
    return None


def _parse_chat_templates(value: Any) -> dict[str, str]:
    """``chat_template`` from tokenizer_config.json: a string or a list of {name, template}."""
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list):
        out: dict[str, str] = {}
        for item in value:
            if (
                isinstance(item, Mapping)
                and isinstance(item.get("name"), str)
                and isinstance(item.get("template"), str)
            ):
                out[item["name"]] = item["template"]
        return out
    return {}


# --------------------------------------------------------------------------- the tokenizer


class Tokenizer:
    """A fast tokenizer plus the special-token and chat-template metadata of a model folder.

    Build one with :meth:`from_model_path`. Thread-safe for concurrent ``encode``/``decode`` and
    ``apply_chat_template`` calls.
    """

    def __init__(
        self,
        tokenizer: _HFTokenizer,
        *,
        chat_templates: Mapping[str, str] | None = None,
        special_tokens: Mapping[str, str | None] | None = None,
        eos_token_ids: Iterable[int] = (),
        bos_token_id: int | None = None,
        add_bos_token: bool | None = None,
    ) -> None:
        self._tok = tokenizer
        # Encoding must return every token: never let tokenizer.json truncate or pad.
        self._tok.no_truncation()
        self._tok.no_padding()

        self._chat_templates: dict[str, str] = dict(chat_templates or {})
        # Strings handed to chat templates (bos_token, eos_token, ...), as transformers does.
        self.special_tokens_map: dict[str, str] = {
            k: v for k, v in (special_tokens or {}).items() if isinstance(v, str)
        }
        self.bos_token: str | None = self.special_tokens_map.get("bos_token")
        self.eos_token: str | None = self.special_tokens_map.get("eos_token")

        eos = set(eos_token_ids)
        eid = tokenizer.token_to_id(self.eos_token) if self.eos_token is not None else None
        if eid is not None:
            eos.add(eid)
        self.eos_token_ids: frozenset[int] = frozenset(eos)

        bid = tokenizer.token_to_id(self.bos_token) if self.bos_token is not None else None
        if bid is not None:
            bos_token_id = bid
        self.bos_token_id: int | None = bos_token_id

        special = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
        special |= self.eos_token_ids
        if self.bos_token_id is not None:
            special.add(self.bos_token_id)
        for tok_str in self.special_tokens_map.values():
            if (tid := tokenizer.token_to_id(tok_str)) is not None:
                special.add(tid)
        self.special_token_ids: frozenset[int] = frozenset(special)

        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)

        # ``add_bos_token: true`` in tokenizer_config.json means "encode() starts with BOS". If
        # tokenizer.json's post-processor already does it, there is nothing to add.
        probe = tokenizer.encode("", add_special_tokens=True).ids
        post_adds_bos = bool(probe) and probe[0] == self.bos_token_id
        self._prepend_bos = (
            bool(add_bos_token) and self.bos_token_id is not None and not post_adds_bos
        )

    # ----------------------------------------------------------------- construction

    @classmethod
    def from_model_path(cls, path: str | Path) -> Tokenizer:
        """Load ``tokenizer.json`` and its metadata from a Hugging Face-format model folder."""
        root = Path(path)
        tok_file = root / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(
                f"tokenizer.json not found in {root} (a fast-tokenizer file is required; "
                "slow tokenizers such as tokenizer.model alone are not supported)"
            )
        tokenizer = _HFTokenizer.from_file(str(tok_file))
        tok_cfg = _read_json(root / "tokenizer_config.json")
        model_cfg = _read_json(root / "config.json")
        gen_cfg = _read_json(root / "generation_config.json")

        templates = _parse_chat_templates(tok_cfg.get("chat_template"))
        jinja_file = root / "chat_template.jinja"
        if jinja_file.is_file():
            templates["default"] = jinja_file.read_text(encoding="utf-8")

        special_tokens = {k: _token_content(tok_cfg.get(k)) for k in _SPECIAL_TOKEN_KEYS}

        eos_ids = _int_ids(_model_config_field(model_cfg, "eos_token_id"))
        eos_ids += _int_ids(gen_cfg.get("eos_token_id"))

        bos_candidates = _int_ids(gen_cfg.get("bos_token_id")) or _int_ids(
            _model_config_field(model_cfg, "bos_token_id")
        )
        add_bos = tok_cfg.get("add_bos_token")
        return cls(
            tokenizer,
            chat_templates=templates,
            special_tokens=special_tokens,
            eos_token_ids=eos_ids,
            bos_token_id=bos_candidates[0] if bos_candidates else None,
            add_bos_token=add_bos if isinstance(add_bos, bool) else None,
        )

    # ----------------------------------------------------------------- encode / decode

    @property
    def backend(self) -> _HFTokenizer:
        """The wrapped ``tokenizers.Tokenizer``."""
        return self._tok

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` applies the post-processor (e.g. BOS)."""
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self._prepend_bos:
            ids = [self.bos_token_id, *ids]  # type: ignore[list-item]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``. Ids outside the vocabulary are ignored. Broken UTF-8 becomes U+FFFD."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        """Raw vocabulary strings of ``ids`` (e.g. ``"Ġhello"``); ``""`` for unknown ids."""
        return [self._tok.id_to_token(int(i)) or "" for i in ids]

    def token_to_id(self, token: str) -> int | None:
        """Id of a vocabulary string (or added token), or None."""
        return self._tok.token_to_id(token)

    # ----------------------------------------------------------------- chat templates

    @property
    def has_chat_template(self) -> bool:
        return bool(self._chat_templates)

    @property
    def chat_template(self) -> str | None:
        """The default chat template source, if any."""
        return self._select_template(None)

    def _select_template(self, tools: Any) -> str | None:
        templates = self._chat_templates
        if not templates:
            return None
        if tools is not None and "tool_use" in templates:
            return templates["tool_use"]
        if "default" in templates:
            return templates["default"]
        if len(templates) == 1:
            return next(iter(templates.values()))
        return None

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        """Render ``messages`` into the prompt text with the model's chat template.

        Template variables: ``messages``, ``add_generation_prompt``, ``tools`` and ``documents``
        (None unless given), the special-token strings (``bos_token``, ``eos_token``, ...), and
        ``extra`` (which overrides any of them). Keys whose value is None are dropped from each
        message, as transformers does. A ``content`` given as a list of parts
        ``[{"type": "text", "text": ...}]`` is flattened to a string (parts joined with ``"\\n"``,
        as vLLM does); any other part type raises :class:`ChatTemplateError`.

        The returned text already contains the BOS token if the template writes it, so encode it
        with ``encode(text, add_special_tokens=False)``, or BOS ends up twice.

        Raises :class:`ChatTemplateError` if there is no template, the template does not compile,
        or rendering fails (including a ``raise_exception(...)`` call in the template).
        """
        template_src = self._select_template(extra.get("tools"))
        if template_src is None:
            raise ChatTemplateError(
                "this model has no chat template (no chat_template in tokenizer_config.json and "
                "no chat_template.jinja); use a plain completion prompt instead"
            )
        try:
            template = _compile(template_src)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template does not compile: {e}") from e

        variables: dict[str, Any] = {
            "tools": None,
            "documents": None,
            **self.special_tokens_map,
            **extra,
            "messages": _normalize_messages(messages),
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            return template.render(**variables)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template error: {e}") from e
        except Exception as e:  # a template can fail in arbitrary Python ways
            raise ChatTemplateError(
                f"chat template failed to render: {type(e).__name__}: {e}"
            ) from e


_TEMPLATE_CACHE: dict[str, jinja2.Template] = {}


def _compile(source: str) -> jinja2.Template:
    template = _TEMPLATE_CACHE.get(source)
    if template is None:
        template = _JINJA_ENV.from_string(source)
        if len(_TEMPLATE_CACHE) < 64:
            _TEMPLATE_CACHE[source] = template
    return template


def _normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """Copy messages as plain dicts, drop None values, flatten text content parts."""
    if not isinstance(messages, (list, tuple)):
        raise ChatTemplateError(f"messages must be a list, got {type(messages).__name__}")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"message {i} must be an object, got {type(message).__name__}")
        msg = {k: v for k, v in message.items() if v is not None}
        content = msg.get("content")
        if isinstance(content, (list, tuple)):
            msg["content"] = _flatten_content(content, i)
        out.append(msg)
    return out


def _flatten_content(parts: Sequence[Any], index: int) -> str:
    texts: list[str] = []
    for part in parts:
        if (
            isinstance(part, Mapping)
            and part.get("type") == "text"
            and isinstance(part.get("text"), str)
        ):
            texts.append(part["text"])
            continue
        kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
        raise ChatTemplateError(
            f"message {index}: unsupported content part {kind!r} (only text parts are supported)"
        )
    return "\n".join(texts)
