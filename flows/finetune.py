"""The Prefect flow `needle`: fingerprint → (skip) → validate → probe → base → prepare → fine-tune
→ evaluate → gate → register.

The flow owns the MLflow run's life (one run per flow run: experiment `needle/<deployment>`, or
`needle-local` when embedded) and the order of the stages; each stage is a task in tasks/stages.py
over a function of needle.pipeline. It first fingerprints its inputs by content (data, base,
training config: ``train_key``); when the champion (or the last challenger) was trained from the
same inputs it ends at once with decision "skipped: data unchanged" unless ``force``. A trained
model is scored with the current champion on the gate set (``gate_data``) and registered: alias
``champion`` when it passes the gate rule (``gate``), ``challenger`` when it loses. A failed run
ends FAILED with the reason as a tag and registers nothing.

Embedded (in-process Prefect, SQLite MLflow under .state/): `needle finetune DATA` (flows/cli.py).
Deployed: see prefect.yaml and deployments/stack-up.sh.
"""

# No `from __future__ import annotations`: Prefect inspects the flow's parameter annotations.

import logging
from pathlib import Path
from typing import Any, Optional

from prefect import flow, runtime

from needle.data.load import LoadedSource
from needle.gate import overlap_count
from needle.pipeline import config_digest
from needle.tracking.mlflow_tracker import MlflowTracker
from needle.tracking.redaction import redact_logs
from needle.train.loop import TrainResult
from needle_flows import gate_record, run_record as rec
from needle_flows.params import FinetuneParams
from needle_flows.paths import resolve_source, state_dir, tracking_uri
from needle_tasks.stages import (
    base, champion, evaluate, export, fingerprint, gate, prepare, probe, register, train, unchanged, validate,
)  # fmt: skip


@flow(name="needle", log_prints=True)
def needle(params: FinetuneParams = FinetuneParams()) -> dict[str, Any]:
    """Fine-tune a tool-calling model and record everything in MLflow."""
    # Prefect forwards the `needle` logger (PREFECT_LOGGING_EXTRA_LOGGERS) but leaves its level
    # at WARNING: training progress is logged at INFO.
    logging.getLogger("needle").setLevel(logging.INFO)
    redact_logs()  # a tracking URI's password never reaches the console or Prefect's log store
    state = state_dir()
    run = rec.start_run(tracking_uri(state))
    # The flow ends the run; metrics MLflow cannot take by the end wait for the next run.
    tracker = MlflowTracker(run.run_id, run.uri, terminate_on_finish=False, spill_dir=rec.pending_metrics_dir())
    try:
        inputs = fingerprint_inputs(params, tracker)
        same = None if params.force else unchanged(run.uri, inputs["train_key"])
        if same is not None:
            return gate_record.end_skipped(run, tracker, inputs, same)
        out = run_stages(params, state, run, tracker, inputs)
    except BaseException as exc:
        rec.end_failed(run, tracker, exc)
        raise
    return rec.end_finished(run, tracker, out)


def fingerprint_inputs(p: FinetuneParams, tracker: MlflowTracker) -> dict[str, str]:
    """The run's inputs by content (seconds: raw bytes, no parsing, no JAX), tagged on the run."""
    inputs = fingerprint(resolve_source(p.data), p.on_error, resolve_source(p.base_model) if p.base_model != "auto"
                         else "auto", p.auto_base(), p.training_identity())  # fmt: skip
    gate_record.tag_inputs(tracker, inputs)
    return inputs


def run_stages(p: FinetuneParams, state: Path, run: rec.MlflowRun, tracker: MlflowTracker,
               inputs: dict[str, str]) -> dict[str, Any]:  # fmt: skip
    """The stages, in order; raises on the first failure (the caller records it)."""
    source = validate(resolve_source(p.data), p.on_error)
    gate_rows = validate(resolve_source(p.gate_data), "fail")  # a bad gate set fails before training
    overlap = overlap_count(source.rows, gate_rows.rows)
    tracker.set_tags({"gate_overlap_rows": overlap})
    if overlap:
        logging.getLogger("needle").warning("%d of the %d gate rows are also in the training data: the gate "
                                            "flatters this model", overlap, len(gate_rows.rows))  # fmt: skip
    hw = probe()
    base_model = base(resolve_source(p.base_model) if p.base_model != "auto" else "auto", p.preset,
                      p.auto_base(), state, tracker, p.max_len)
    data_cfg = p.data_config(p.data, base_model.model_cfg)
    prepared = prepare(data_cfg, source, base_model.tokenizer, state / "prepared")
    rec.record_inputs(run, tracker, p, data_cfg, base_model, prepared, hw)
    train_cfg, optim_cfg = p.training_configs()
    key = config_digest(prepared.fingerprint, base_model.model_cfg, train_cfg, optim_cfg, p.lora, base_model.model_dir)
    run_dir = state / "runs" / str(runtime.flow_run.id or "local")
    # Keyed by data and configs, not by flow run: re-running a killed flow resumes its checkpoints.
    # A forced retrain trains afresh (keyed by its flow run too): resuming the finished folder of
    # the same inputs would hand back the old model with 0 steps, whatever made the user force it.
    if p.force:
        key = config_digest(key, "force", str(runtime.flow_run.id))
    tuned = train(prepared, base_model, train_cfg, optim_cfg, p.lora, state / "finetune" / f"{p.mode}-{key}", tracker,
                     p.cluster)  # fmt: skip
    report = evaluate(base_model, tuned.model_dir, prepared, p.eval, run_dir / "eval")
    exports = export(tuned.model_dir, run_dir / "export")
    metrics = rec.record_results(run, tracker, base_model, prepared, tuned, report, run_dir, exports)
    outcome, version = gate_and_register(p, state, run, tracker, tuned, gate_rows, run_dir,
                                         {**report.tuned, **inputs, "data_fingerprint": prepared.fingerprint,
                                          "gate_overlap_rows": overlap,  # the version names its exports
                                          **{f"export.{fmt}": f"runs:/{run.run_id}/export/{fmt}" for fmt in exports}})  # fmt: skip
    return {"hw": hw, "metrics": {"train_loss": tuned.train_loss, "val_loss": tuned.val_loss, **metrics},
            "comparison": report.comparison,  # base vs tuned: the table `needle finetune` prints
            "model_version": version, "model_dir": tuned.model_dir, "data_fingerprint": prepared.fingerprint,
            "prepared_dir": str(prepared.directory), "base": base_model.record or {"model_dir": base_model.model_dir},
            "decision": outcome.decision.label, "gate_fingerprint": outcome.fingerprint, **inputs}


def gate_and_register(p: FinetuneParams, state: Path, run: rec.MlflowRun, tracker: MlflowTracker,
                      tuned: TrainResult, gate_rows: LoadedSource, run_dir: Path,
                      tags: dict[str, Any], model_run_id: Optional[str] = None) -> tuple[Any, Any]:  # fmt: skip
    """Score the tuned model and the champion on the gate set, record the verdict in ``run``,
    register the version (from the ``model`` artifact of ``model_run_id``, default ``run``) with
    its lineage (alias champion or challenger); returns (outcome, version or None)."""
    current = champion(run.uri, state / "registry-cache")
    outcome = gate(tuned.model_dir, current, gate_rows, p.eval, p.gate, run_dir / "gate")
    gate_record.record_gate(run, tracker, outcome, step=tuned.final_step)
    model_run_id = model_run_id or run.run_id
    lineage = {"git_commit": rec.git_commit(), "prefect.flow_run_id": str(runtime.flow_run.id),
               "mlflow.run_id": model_run_id, "base_model": p.base_model}  # fmt: skip
    version = (register(model_run_id, run.uri, {**tags, **lineage, **outcome.version_tags()}, outcome)
               if p.register_model else None)  # fmt: skip
    return outcome, version
