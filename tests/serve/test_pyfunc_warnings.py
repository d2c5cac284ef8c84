"""Logging the pyfunc model prints nothing but needle's lines: MLflow warns about a ``predict``
without type hints (and about integer columns of a schema it infers); needle's model has the hints
and an explicit signature, so saving it raises no UserWarning or FutureWarning. In a child
process: MLflow shows its type-hint warning once per process and caches the check."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

CHILD = """
import json, sys, warnings
from needle.serve.pyfunc import save_pyfunc

with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    save_pyfunc(sys.argv[1], sys.argv[2])
print(json.dumps([[w.category.__name__, str(w.message)[:200]] for w in seen
                  if issubclass(w.category, (UserWarning, FutureWarning))]))
"""


def test_saving_the_pyfunc_raises_no_user_warning(tiny_model_dir: Path, tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-c", CHILD, str(tiny_model_dir), str(tmp_path / "pyfunc")],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []
    assert (tmp_path / "pyfunc" / "MLmodel").is_file()

