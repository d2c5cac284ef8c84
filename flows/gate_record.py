"""What the retraining loop records: the run's input fingerprints, a skip, the gate's decision.

Beside flows/run_record.py (the run's life and its training record): these write the lineage
tags, end a skipped run, and publish the gate's scores and verdict in MLflow (run tags, metrics,
``gate/`` artifacts) and in Prefect (a table artifact, key ``needle-gate``).

    tag_inputs(tracker, inputs)                        # data_digest, base_key, config_key, train_key
    end_skipped(run, tracker, inputs, same)            # decision "skipped: data unchanged"
    record_gate(run, tracker, outcome)                 # both score sets, fingerprint, decision
"""

from typing import Any

import mlflow
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from needle.gate import GateOutcome, decision_table
from needle.tracking.redaction import redact_uri
from needle.tracking.tracker import Tracker
from needle_flows.run_record import MlflowRun

DECISION_KEY = "needle-decision"
GATE_KEY = "needle-gate"
SKIPPED = "skipped: data unchanged"


def tag_inputs(tracker: Tracker, inputs: dict[str, str]) -> None:
    """The run's inputs by content, as run tags (the same keys go on its model version)."""
    tracker.set_tags(inputs)


def end_skipped(run: MlflowRun, tracker: Tracker, inputs: dict[str, str], same: dict[str, str]) -> dict[str, Any]:
    """End a run whose inputs equal those of version ``same`` (FINISHED, decision tagged, a
    Prefect artifact saying why); nothing is trained or registered."""
    why = (f"data, base and training config equal those of version {same['version']} (alias `{same['alias']}`, "
           f"run `{same['run_id']}`): train_key `{inputs['train_key']}`")  # fmt: skip
    tracker.set_tags({"decision": SKIPPED, "decision.reason": why, "decision.same_version": same["version"]})
    tracker.finish()
    mlflow.end_run("FINISHED")
    lines = [f"# needle run: {SKIPPED}", "", why, "", "| input | fingerprint |", "|---|---|",
             *[f"| {k} | `{v}` |" for k, v in inputs.items()], "",
             f"MLflow run `{run.run_id}` in `{run.experiment}`: {run.info['ui_link']}",
             "", "Pass `force: true` to retrain anyway."]  # fmt: skip
    create_markdown_artifact(key=DECISION_KEY, markdown=redact_uri("\n".join(lines) + "\n"), description=SKIPPED)
    print(f"{SKIPPED}: {why}")
    return {"decision": SKIPPED, "skipped": True, "same_version": same, "model_version": None, "model_dir": None,
            **inputs, "run_id": run.run_id, "experiment_id": run.experiment_id,
            "tracking_uri": redact_uri(run.uri)}  # fmt: skip


def record_gate(run: MlflowRun, tracker: Tracker, outcome: GateOutcome, step: int = 0) -> list[dict[str, Any]]:
    """Both score sets as metrics (``gate_challenger_<m>``, ``gate_champion_<m>``), the decision
    and gate fingerprint as tags, the gate reports under ``gate/``, and the table artifact."""
    metrics = {f"gate_{side}_{m}": float(v) for side, scores in (("challenger", outcome.challenger),
                                                                  ("champion", outcome.champion or {}))
               for m, v in scores.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}  # fmt: skip
    tracker.log_metrics(metrics, step=step)
    tracker.set_tags({"decision": outcome.decision.label, "gate_fingerprint": outcome.fingerprint,
                      "gate_digest": outcome.gate_digest,
                      "gate.champion_version": outcome.champion_version or "none"})  # fmt: skip
    tracker.log_artifact(outcome.report_dir, "gate")
    table = decision_table(outcome.challenger, outcome.champion, outcome.decision)
    champ = f"version {outcome.champion_version}" if outcome.champion_version else "no champion"
    create_table_artifact(key=GATE_KEY, table=table,
                          description=f"{outcome.decision.label} (challenger vs {champ}, gate {outcome.fingerprint}, "
                                      f"{outcome.n_rows} rows)")  # fmt: skip
    print(f"gate {outcome.fingerprint} ({outcome.n_rows} rows), challenger vs {champ}: {outcome.decision.label}")
    return table
