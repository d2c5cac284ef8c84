"""Where the shell finds things: the checkout, the state dir, the MLflow store, relative sources.

No Prefect or MLflow import here: the entry point (flows/cli.py) reads these before it sets up
the environment Prefect starts with.
"""

import os
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[1]


def state_dir() -> Path:
    """Where runs, caches and the default MLflow store live: $NEEDLE_STATE_DIR or .state/."""
    return Path(os.environ.get("NEEDLE_STATE_DIR") or CHECKOUT / ".state").resolve()


def tracking_uri(state: Path) -> str:
    """MLFLOW_TRACKING_URI if set, else an absolute SQLite store in the state dir (never cwd)."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{state / 'mlflow.db'}"


def resolve_source(source: str) -> str:
    """Absolute path for a relative local source found in the checkout; other sources unchanged.

    The worker runs in the checkout, but the embedded flow may start anywhere; the bundled
    sample paths must work from both.
    """
    p = Path(source)
    if p.is_absolute() or p.exists() or any(ch in source for ch in "*?["):
        return str(p.resolve()) if p.exists() else source
    in_checkout = CHECKOUT / p
    return str(in_checkout) if in_checkout.exists() else source
