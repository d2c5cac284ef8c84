"""tests/train: one persistent XLA cache per session, shared with the subprocesses it starts."""

from __future__ import annotations

import os

import pytest

from needle.hardware import enable_compilation_cache


@pytest.fixture(scope="session", autouse=True)
def compilation_cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    # Resume and multi-device tests rerun the same programs in child processes: compiling
    # them once is most of these tests' time on a small CPU.
    path = str(tmp_path_factory.mktemp("jax-cache"))
    enable_compilation_cache(path)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = path
    return path
