"""Run the real cactus-needle ``finetune_local`` in its own virtualenv and collect its timings.

The virtualenv is the library's own side environment (``needle.model.needle3.cactus_env``:
``$NEEDLE_CACTUS_VENV`` or ``~/.cache/needle/cactus-needle-3.2.8``, created on demand with pip);
its package is also called ``needle``, which is why it never shares an interpreter with this
repository. ``bench/cactus_worker.py`` runs
there in isolated mode. Any failure (no network for pip, an API change in the package, a
timeout) comes back as ``{"ok": False, "error": reason}`` instead of an exception.

    from bench.cactus import run_cactus
    result = run_cactus(jsonl, spec, timeout_s=1200)
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from needle.errors import ModelImportError
from needle.model.needle3.cactus_env import ensure_cactus_env

WORKER = Path(__file__).with_name("cactus_worker.py")


def run_cactus(spec: dict[str, Any], timeout_s: float = 1500) -> dict[str, Any]:
    """Run the worker with ``spec`` (see cactus_worker.py); never raises."""
    try:
        py = ensure_cactus_env()
    except ModelImportError as e:
        return {"ok": False, "error": str(e)}
    with tempfile.TemporaryDirectory(prefix="bench-cactus-") as tmp:
        spec = {**spec, "workdir": os.path.join(tmp, "work")}
        spec_path, out_path = Path(tmp, "spec.json"), Path(tmp, "out.json")
        spec_path.write_text(json.dumps(spec))
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS")}
        env.setdefault("JAX_PLATFORMS", "cpu")
        try:
            done = subprocess.run([str(py), "-I", str(WORKER), str(spec_path), str(out_path)],
                                  capture_output=True, text=True, timeout=timeout_s, cwd=tmp, env=env)
        except subprocess.TimeoutExpired:
            return {"ok": False, "error": f"finetune_local did not finish within {timeout_s:.0f} s"}
        if not out_path.exists():
            return {"ok": False, "error": f"worker exited {done.returncode} without a result: {done.stderr[-800:]}"}
        return json.loads(out_path.read_text())
