"""The Prefect flow `needle`: validate → probe → base → prepare → fine-tune → evaluate → register.

The flow owns the MLflow run's life (one run per flow run: experiment `needle/<deployment>`, or
`needle-local` when embedded) and the order of the stages; each stage is a task in tasks/stages.py
over a function of needle.pipeline. A failed run ends FAILED with the reason as a tag and
registers nothing.

Embedded (in-process Prefect, SQLite MLflow under .state/): `needle finetune DATA` (flows/cli.py).
Deployed: see prefect.yaml and deployments/stack-up.sh.
"""

# No `from __future__ import annotations`: Prefect inspects the flow's parameter annotations.

import logging
from pathlib import Path
from typing import Any

from prefect import flow, runtime

from flows import run_record as rec
from flows.params import FinetuneParams
from flows.paths import resolve_source, state_dir, tracking_uri
from needle.pipeline import config_digest
from needle.tracking import MlflowTracker, redact_logs
from tasks.stages import base, evaluate, export, finetune, prepare, probe, register, validate


@flow(name="needle", log_prints=True)
def needle(params: FinetuneParams = FinetuneParams()) -> dict[str, Any]:
    """Fine-tune a tool-calling model and record everything in MLflow."""
    # Prefect forwards the `needle` logger (PREFECT_LOGGING_EXTRA_LOGGERS) but leaves its level
    # at WARNING: training progress is logged at INFO.
    logging.getLogger("needle").setLevel(logging.INFO)
    redact_logs()  # a tracking URI's password never reaches the console or Prefect's log store
    state = state_dir()
    run = rec.start_run(tracking_uri(state))
    tracker = MlflowTracker(run.run_id, run.uri, terminate_on_finish=False)  # the flow ends the run
    try:
        out = run_stages(params, state, run, tracker)
    except BaseException as exc:
        rec.end_failed(run, tracker, exc)
        raise
    return rec.end_finished(run, tracker, out)


def run_stages(p: FinetuneParams, state: Path, run: rec.MlflowRun, tracker: MlflowTracker) -> dict[str, Any]:
    """The stages, in order; raises on the first failure (the caller records it)."""
    source = validate(resolve_source(p.data), p.on_error)
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
    tuned = finetune(prepared, base_model, train_cfg, optim_cfg, p.lora, state / "finetune" / f"{p.mode}-{key}", tracker)
    report = evaluate(base_model, tuned.model_dir, prepared, p.eval, run_dir / "eval")
    exports = export(tuned.model_dir, run_dir / "export")
    metrics = rec.record_results(run, tracker, base_model, prepared, tuned, report, run_dir, exports)
    version = register(run.run_id, run.uri, report.tuned) if p.register_model else None
    return {"hw": hw, "metrics": {"train_loss": tuned.train_loss, "val_loss": tuned.val_loss, **metrics},
            "model_version": version, "model_dir": tuned.model_dir, "data_fingerprint": prepared.fingerprint,
            "prepared_dir": str(prepared.directory), "base": base_model.record or {"model_dir": base_model.model_dir}}
