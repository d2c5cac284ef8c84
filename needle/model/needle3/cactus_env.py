"""The side virtualenv that holds cactus-needle (Needle's reference package) for its own writers.

cactus-needle's import name is also ``needle``, so it never shares an interpreter with this
project: its code runs in a virtualenv of its own, from scripts started with ``python -I`` that
import nothing of this repository (``needle/model/needle3/cact_worker.py``, ``bench/cactus_worker.py``).
The virtualenv is ``$NEEDLE_CACTUS_VENV`` or ``~/.cache/needle/cactus-needle-<version>``, created
on first use with pip (the package registry must be reachable then, never afterwards).

    py = ensure_cactus_env()                       # Path of its python, or ModelImportError
    run_in_cactus_env(WORKER, ["spec.json"], timeout_s=600)
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from needle.errors import ModelImportError

CACTUS_VERSION = "3.2.8"
PACKAGE = f"cactus-needle[train]=={CACTUS_VERSION}"


def cactus_venv() -> Path:
    """Where the side virtualenv lives."""
    default = Path.home() / ".cache" / "needle" / f"cactus-needle-{CACTUS_VERSION}"
    return Path(os.environ.get("NEEDLE_CACTUS_VENV") or default)


def cactus_python() -> Path:
    venv = cactus_venv()
    return venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def _usable(py: Path) -> bool:
    probe = [str(py), "-I", "-c", "import needle.model.finetune, needle.model.export, sentencepiece"]
    return py.exists() and subprocess.run(probe, capture_output=True, timeout=300).returncode == 0


def ensure_cactus_env(timeout_s: float = 900) -> Path:
    """The side virtualenv's python, created with pip when missing; ModelImportError naming why not."""
    py = cactus_python()
    if _usable(py):
        return py
    steps = [
        [sys.executable, "-m", "venv", str(cactus_venv())],
        [str(py), "-m", "pip", "install", "-q", "--upgrade", "pip"],
        [str(py), "-m", "pip", "install", "-q", PACKAGE],
    ]
    for cmd in steps:
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired as e:
            raise ModelImportError(f"{cactus_venv()}: `{' '.join(cmd)}` timed out after {timeout_s:.0f} s") from e
        if done.returncode:
            tail = (done.stderr or done.stdout)[-600:]
            raise ModelImportError(f"{cactus_venv()}: could not install {PACKAGE}: `{' '.join(cmd)}` failed: {tail}")
    if not _usable(py):
        raise ModelImportError(f"{cactus_venv()}: {PACKAGE} installed but its modules do not import")
    return py


def run_in_cactus_env(script: Path, args: list[str], timeout_s: float = 900) -> subprocess.CompletedProcess[str]:
    """Run ``script`` with the side virtualenv's python in isolated mode; raise with its stderr on failure."""
    py = ensure_cactus_env()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS")}
    env.setdefault("JAX_PLATFORMS", "cpu")
    try:
        done = subprocess.run([str(py), "-I", str(script), *args], capture_output=True, text=True,
                              timeout=timeout_s, env=env)  # fmt: skip
    except subprocess.TimeoutExpired as e:
        raise ModelImportError(f"{script.name} in {cactus_venv()} did not finish within {timeout_s:.0f} s") from e
    if done.returncode:
        raise ModelImportError(f"{script.name} in {cactus_venv()} failed ({done.returncode}): {done.stderr[-1500:]}")
    return done
