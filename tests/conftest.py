"""Shared fixtures: a small generated dataset, a copy with one bad row, and flow parameters."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

BAD_LINE = 3


@pytest.fixture(scope="session", autouse=True)
def own_needle_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Tests never read or fill the user's ~/.cache/needle (prepared data, registry downloads):
    a cache hit from another session would carry that session's file paths."""
    import os

    os.environ["NEEDLE_CACHE_DIR"] = str(tmp_path_factory.mktemp("needle-cache"))


@pytest.fixture(scope="session")
def sample_data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A few rows of the synthetic base and new-tool datasets (tiny models train in seconds)."""
    from needle.data.sample import write_sample

    return write_sample(tmp_path_factory.mktemp("sample"), seed=0, n_base=96, n_new=64)


@pytest.fixture(scope="session")
def bad_line() -> int:
    """The 1-based line of ``bad_data`` that is broken."""
    return BAD_LINE


@pytest.fixture(scope="session")
def bad_data(sample_data: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The new-tool rows with line BAD_LINE replaced by something that is not JSON."""
    lines = sample_data["new"].read_text(encoding="utf-8").splitlines(keepends=True)
    lines[BAD_LINE - 1] = '{"query": "broken row", "tools": [\n'
    path = tmp_path_factory.mktemp("bad") / "bad.jsonl"
    path.write_text("".join(lines), encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def tiny_flow_params(sample_data: dict[str, Path]) -> dict[str, Any]:
    """FinetuneParams for a run that takes seconds: tiny preset, a few steps, a few eval rows."""
    return {
        "data": str(sample_data["new"]),
        "base_model": "auto",
        "base_data": str(sample_data["base"]),
        "base_steps": 4,
        "preset": "tiny",
        "steps": 4,
        "batch_size": 8,
        "max_len": 320,  # the tiny preset's: `needle train --preset tiny` prepares the same rows
        "train": {"log_every": 1, "checkpoint_every": 2},
        "eval": {"max_rows": 4, "batch_size": 4, "max_new_tokens": 8},
    }


@pytest.fixture(scope="module", autouse=True)
def release_compiled_programs() -> Any:
    """After each test module, drop JAX's compiled programs and collect garbage: one pytest process
    runs the whole suite, and what every module compiled would otherwise stay resident to the end."""
    yield
    import gc
    import sys

    if "jax" in sys.modules:
        sys.modules["jax"].clear_caches()
    gc.collect()


CHILD_ENV = "NEEDLE_TEST_OWN_PROCESS"


def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> Any:
    """A test marked ``own_process`` runs in a fresh ``python -m pytest`` of its own node id: it
    starts a Ray driver in its process, which outlives ``ray.shutdown`` there (its threads and
    native state), and nothing of it should reach the tests that the suite's process runs after."""
    import os
    import subprocess
    import sys

    if pyfuncitem.get_closest_marker("own_process") is None or os.environ.get(CHILD_ENV) == "1":
        return None
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--timeout=900", pyfuncitem.nodeid]
    proc = subprocess.run(cmd, cwd=pyfuncitem.config.rootpath, env={**os.environ, CHILD_ENV: "1"},
                          capture_output=True, text=True)  # fmt: skip
    if proc.returncode != 0:
        pytest.fail(f"{pyfuncitem.nodeid} in its own process: exit {proc.returncode}\n{proc.stdout[-6000:]}\n"
                    f"{proc.stderr[-3000:]}", pytrace=False)  # fmt: skip
    return True


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Files marked slow as a whole (the end-to-end ones) run first, those with more tests before
    those with fewer: `make test`'s workers take whole files in this order, so the longest start
    early and the two workers finish together instead of one running the last big file alone."""
    from collections import Counter

    per_file = Counter(item.path for item in items)

    def key(item: pytest.Item) -> tuple[int, int]:
        module = item.getparent(pytest.Module)
        if module is not None and module.get_closest_marker("slow") is not None:
            return (0, -per_file[item.path])
        return (1, 0)

    items.sort(key=key)  # stable: each file's tests stay together and in their own order
