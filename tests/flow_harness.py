"""The in-process flow environment shared by the flow tests (imported as ``flow_harness``:
pytest puts tests/ on the path): a throwaway Prefect server, MLflow store and needle state dir."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest


@contextmanager
def flow_harness(root: Path) -> Iterator[str]:
    """Prefect test harness, SQLite MLflow and state under ``root``; yields the tracking URI."""
    from prefect.settings import PREFECT_LOCAL_STORAGE_PATH, PREFECT_MEMO_STORE_PATH, temporary_settings
    from prefect.testing.utilities import prefect_test_harness

    uri = f"sqlite:///{root / 'mlflow.db'}"
    # Cached task results and the memo store would otherwise land in ~/.prefect.
    local = {PREFECT_LOCAL_STORAGE_PATH: root / "storage", PREFECT_MEMO_STORE_PATH: root / "memo_store.toml"}
    with pytest.MonkeyPatch.context() as mp, temporary_settings(updates=local):
        mp.setenv("NEEDLE_STATE_DIR", str(root / "state"))
        mp.setenv("MLFLOW_TRACKING_URI", uri)
        mp.setenv("JAX_PLATFORMS", "cpu")
        with prefect_test_harness(server_startup_timeout=120):
            yield uri
