"""Run the real cactus-needle ``finetune_local`` in its own virtualenv and collect its timings.

The virtualenv lives in ``.cache/bench-venv`` (git-ignored) and is created on demand with
``pip install 'cactus-needle[train]==VERSION'``; its package is also called ``needle``, which
is why it never shares an interpreter with this repository. ``bench/cactus_worker.py`` runs
there in isolated mode. Any failure (no network for pip, an API change in the package, a
timeout) comes back as ``{"ok": False, "error": reason}`` instead of an exception.

    from bench.cactus import run_cactus
    result = run_cactus(jsonl, spec, timeout_s=1200)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.fixtures import REPO

VENV = REPO / ".cache" / "bench-venv"
PACKAGE = "cactus-needle[train]==3.2.8"
WORKER = Path(__file__).with_name("cactus_worker.py")


def venv_python() -> Path:
    return VENV / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def ensure_venv(timeout_s: float = 900) -> str | None:
    """Create the virtualenv and install the package if needed; return an error text or None."""
    py = venv_python()
    probe = [str(py), "-I", "-c", "import needle.model.finetune, sentencepiece"]
    if py.exists() and subprocess.run(probe, capture_output=True, timeout=120).returncode == 0:
        return None
    steps = [[sys.executable, "-m", "venv", str(VENV)],
             [str(py), "-m", "pip", "install", "-q", "--upgrade", "pip"],
             [str(py), "-m", "pip", "install", "-q", PACKAGE]]
    for cmd in steps:
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return f"timed out after {timeout_s:.0f} s: {' '.join(cmd)}"
        if done.returncode:
            return f"{' '.join(cmd)} failed ({done.returncode}): {(done.stderr or done.stdout)[-800:]}"
    if subprocess.run(probe, capture_output=True, timeout=120).returncode:
        return f"{PACKAGE} installed but `import needle.model.finetune` fails in {VENV}"
    return None


def run_cactus(spec: dict[str, Any], timeout_s: float = 1500) -> dict[str, Any]:
    """Run the worker with ``spec`` (see cactus_worker.py); never raises."""
    error = ensure_venv()
    if error:
        return {"ok": False, "error": f"could not set up {VENV}: {error}"}
    with tempfile.TemporaryDirectory(prefix="bench-cactus-") as tmp:
        spec = {**spec, "workdir": os.path.join(tmp, "work")}
        spec_path, out_path = Path(tmp, "spec.json"), Path(tmp, "out.json")
        spec_path.write_text(json.dumps(spec))
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS")}
        env.setdefault("JAX_PLATFORMS", "cpu")
        try:
            done = subprocess.run([str(venv_python()), "-I", str(WORKER), str(spec_path), str(out_path)],
                                  capture_output=True, text=True, timeout=timeout_s, cwd=tmp, env=env)
        except subprocess.TimeoutExpired:
            return {"ok": False, "error": f"finetune_local did not finish within {timeout_s:.0f} s"}
        if not out_path.exists():
            return {"ok": False, "error": f"worker exited {done.returncode} without a result: {done.stderr[-800:]}"}
        return json.loads(out_path.read_text())
