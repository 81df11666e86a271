"""Shared pytest fixtures.

Sections:

* Tiny model folders: a byte-level BPE tokenizer and random 2-layer checkpoints built once per
  test session (see ``tests/tiny_models.py``), no model hub needed.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from pd_services import PDDeployment  # noqa: E402
from tiny_models import (  # noqa: E402
    ARCHS,
    LLAMA3_ROPE_SCALING,
    build_tiny_checkpoint,
    build_tokenizer,
)

# --------------------------------------------------------------------------- tiny model folders


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with only tokenizer.json + tokenizer_config.json (ChatML template)."""
    path = tmp_path_factory.mktemp("tiny-tokenizer")
    build_tokenizer(path)
    return path


def _checkpoint(tmp_path_factory: pytest.TempPathFactory, arch: str, **kwargs: object) -> Path:
    name = f"tiny-{arch}" + ("-llama3rope" if kwargs.get("rope_scaling") else "")
    path = tmp_path_factory.mktemp(name)
    return build_tiny_checkpoint(path, arch, **kwargs)  # type: ignore[arg-type]


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _checkpoint(tmp_path_factory, "llama")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _checkpoint(tmp_path_factory, "qwen2")


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _checkpoint(tmp_path_factory, "qwen3")


@pytest.fixture(scope="session")
def tiny_mistral_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _checkpoint(tmp_path_factory, "mistral")


@pytest.fixture(scope="session")
def tiny_llama3_rope_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Llama with Llama-3 RoPE scaling (factor 8, original max positions 64)."""
    return _checkpoint(tmp_path_factory, "llama", rope_scaling=LLAMA3_ROPE_SCALING)


@pytest.fixture(scope="session", params=ARCHS)
def tiny_model_dir(request: pytest.FixtureRequest) -> Path:
    """A tiny checkpoint folder, parametrized over all archs.

    Pick some archs indirectly with
    ``@pytest.mark.parametrize("tiny_model_dir", ["llama", "qwen3"], indirect=True)``.
    """
    arch = request.param
    if arch not in ARCHS:
        raise ValueError(f"tiny_model_dir: unknown arch {arch!r}; expected one of {ARCHS}")
    return request.getfixturevalue(f"tiny_{arch}_dir")


# --------------------------------------------------------------------------- PD deployments
# Session-scoped: the PD service tests and the router's end-to-end tests share them.


@pytest.fixture(scope="session")
def pd_tcp(tiny_llama_dir):
    with PDDeployment(tiny_llama_dir, page_size=16, backend="tcp") as pd:
        yield pd
        pd.assert_pools_whole()  # after every test that used it


@pytest.fixture(scope="session")
def pd_torch(tiny_qwen2_dir):
    with PDDeployment(tiny_qwen2_dir, page_size=1, backend="torch") as pd:
        yield pd
        pd.assert_pools_whole()
