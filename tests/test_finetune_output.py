"""`needle finetune` ends with the before/after table it measured (the one `needle evaluate`
prints, for base and tuned), without training: in a child process (Prefect's logging set up by the
entry point stays out of pytest's capture), the flow is replaced by a recorded result."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from needle.eval.report import before_after, format_table

ROOT = Path(__file__).resolve().parents[1]
COMPARISON = {
    "n": {"base": 4, "tuned": 4, "delta": 0},
    "exact_match": {"base": 0.25, "tuned": 0.75, "delta": 0.5},
    "constrained_exact_match": {"base": 0.5, "tuned": 1.0, "delta": 0.5},
}
CHILD = """
import json, sys
import needle_flows.finetune
from needle_flows.cli import main

def needle(params):
    print("flow params preset", params.preset)
    return {**json.loads(sys.argv[1]), "model_version": {"version": "1", "alias": "champion"}}

needle_flows.finetune.needle = needle
sys.exit(main(["finetune", "data/sample/new.jsonl", "--preset", "tiny", "--steps", "1"]))
"""


def test_finetune_prints_base_vs_tuned_free_and_constrained(tmp_path: Path) -> None:
    state = tmp_path / "state"
    uri = f"sqlite:///{state / 'mlflow.db'}"
    result = {"tracking_uri": uri, "run_id": "abc", "experiment_id": "1", "model_dir": str(tmp_path / "model"),
              "decision": "champion (first model)", "comparison": COMPARISON}
    env = {**os.environ, "NEEDLE_STATE_DIR": str(state), "PREFECT_HOME": str(state / "prefect"),
           "MLFLOW_TRACKING_URI": uri}
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(result)], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "flow params preset tiny" in out
    table = format_table(before_after(COMPARISON))
    assert table in out
    assert out.index("Tuned model:") < out.index(table) < out.index("Decision: champion")
    row = next(line for line in table.splitlines() if line.startswith("| exact_match"))
    assert [c.strip() for c in row.split("|")[1:-1]] == ["exact_match", "0.2500", "0.7500", "0.5000", "1.0000"]
