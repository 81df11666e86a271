"""Model preparation: GGUF -> Hugging Face folder conversion and the cached default model.

Names are resolved lazily, so `python -m common.model_store.default_model` runs cleanly and
importing the package stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "DEFAULT_MODEL_NAME": "default_model",
    "cache_root": "default_model",
    "embedded_gguf_path": "default_model",
    "ensure_default_model": "default_model",
    "convert_gguf_to_hf": "gguf_to_hf",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
