"""The Prefect flow behind deployment `needle/sweep`: an Optuna search over FinetuneParams.

One parent MLflow run per flow run (experiment `needle/sweep`, `needle-local` embedded) holds the
search space, the sampler, the best trial and a plot of the objective; each trial is a child run
(tag ``mlflow.parentRunId``) with the same params, curves and evaluation as a finetune run, so the
MLflow UI expands the parent to its children and compares them key by key. Trials run
``n_jobs`` at a time (default: the machine's cores, at most the trial count). With ``cluster``,
each trial trains on a Ray cluster's workers (``needle/train/launch.py``) while the study, the
MLflow records and evaluation stay here, so trials spread over the cluster. A trial that fails
(a bad value in the space, a NaN loss) is a FAILED child with its reason, recorded in the study as
failed; the sweep goes on. The best trial's model then goes through the same gate as a finetune
run and is registered: alias champion if it wins, challenger if it loses.

    needle_sweep(SweepParams(base=FinetuneParams(preset="tiny", steps=20), n_trials=4, sampler="grid",
                             space={"lora.rank": {"type": "categorical", "choices": [4, 8]}}))
"""

# No `from __future__ import annotations`: Prefect inspects the flow's parameter annotations.

import json
import logging
import os
import threading
from pathlib import Path
from typing import Any, Literal, Optional

from prefect import flow, runtime
from prefect.artifacts import create_table_artifact
from pydantic import BaseModel, ConfigDict, Field, model_validator

from needle import pipeline
from needle.config import ClusterConfig
from needle.data.load import LoadedSource
from needle.tracking.mlflow_tracker import MlflowTracker
from needle.tracking.redaction import redact_logs, redact_uri
from needle.train.launch import connect_ray, ray_address
from needle.train.loop import TrainResult
from needle_flows import run_record as rec
from needle_flows.finetune import gate_and_register
from needle_flows.params import FinetuneParams
from needle_flows.paths import resolve_source, state_dir, tracking_uri
from needle_tasks.stages import fingerprint, probe, validate

log = logging.getLogger("needle.sweep")
TRIALS_KEY = "needle-sweep-trials"
_RECORD_LOCK = threading.Lock()  # matplotlib and the artifact uploads of record_results, one trial at a time
# The base and the prepared data are built once and cached on disk (their temp folders are named
# by process id): trials in threads take turns, the first builds, the others reuse.
_BUILD_LOCK = threading.Lock()


class Dimension(BaseModel):
    """One searched parameter: a float or int range (``log`` for a log scale) or a list of choices."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["float", "int", "categorical"]
    low: Optional[float] = None
    high: Optional[float] = None
    log: bool = False
    choices: Optional[list[Any]] = None

    @model_validator(mode="after")
    def _complete(self) -> "Dimension":
        if self.type == "categorical" and not self.choices:
            raise ValueError("a categorical dimension needs choices")
        if self.type != "categorical" and (self.low is None or self.high is None or self.low > self.high):
            raise ValueError(f"a {self.type} dimension needs low <= high")
        return self

    def suggest(self, trial: Any, name: str) -> Any:
        if self.type == "categorical":
            return trial.suggest_categorical(name, self.choices)
        if self.type == "int":
            return trial.suggest_int(name, int(self.low), int(self.high), log=self.log)
        return trial.suggest_float(name, self.low, self.high, log=self.log)


class SweepParams(BaseModel):
    """A search: the base parameters, the space (dotted FinetuneParams keys), sampler and budget."""

    model_config = ConfigDict(extra="forbid")

    base: FinetuneParams = Field(default_factory=FinetuneParams, description="what every trial starts from")
    space: dict[str, Dimension] = Field(
        default_factory=lambda: {"optim.lr": Dimension(type="float", low=1e-3, high=1e-2, log=True)},
        description="dotted FinetuneParams keys (optim.lr, lora.rank, steps, train.warmup_steps, ...) to search",
    )
    n_trials: int = Field(8, gt=0, description="trials to run (grid: at most the grid's size)")
    sampler: Literal["grid", "tpe"] = Field("tpe", description="grid: every combination of choices; tpe: Bayesian")
    objective: Literal["exact_match", "val_loss"] = Field(
        "exact_match", description="exact_match on the test split (maximised) or the final val_loss (minimised)"
    )
    n_jobs: Optional[int] = Field(None, gt=0, description="trials at once (None: the machine's cores, or on a "
                                  "cluster its CPUs over each trial's workers)")
    cluster: Optional[ClusterConfig] = Field(
        None, description="train each trial on this Ray cluster (address, else $RAY_ADDRESS) on `workers` of its "
        "workers; the study, tracking and evaluation stay in the flow run. None: trials train in the flow's process"
    )
    seed: int = Field(0, description="the sampler's seed")
    storage: Optional[str] = Field(
        None, description="an Optuna storage URL for the study (sqlite:////abs/path.db on one machine, a database "
        "URL for many; the study is named needle-sweep-<parent run id>); None: in the flow run's memory"
    )

    @model_validator(mode="after")
    def _grid_is_discrete(self) -> "SweepParams":
        if self.sampler == "grid" and any(d.type != "categorical" for d in self.space.values()):
            raise ValueError("the grid sampler needs categorical dimensions (list their choices)")
        return self

    def trial_params(self, values: dict[str, Any]) -> FinetuneParams:
        """The base parameters with the trial's values set at their dotted keys (validated)."""
        merged = self.base.model_dump(mode="json", exclude_unset=True)
        for dotted, value in values.items():
            node = merged
            *parents, leaf = dotted.split(".")
            for key in parents:
                if not isinstance(node.get(key), dict):
                    node[key] = {}
                node = node[key]
            node[leaf] = value
        return FinetuneParams(**{**merged, "force": True})


def n_parallel(p: SweepParams, cluster_cpus: Optional[int] = None) -> int:
    """Trials at once: n_jobs, else the cores this process may use (on a cluster: its CPUs over
    each trial's workers); never more than the trials."""
    if cluster_cpus is not None and p.cluster is not None:
        cores = cluster_cpus // p.cluster.workers
    else:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(p.n_jobs or cores, p.n_trials))


def join_cluster(p: SweepParams) -> tuple[Optional[ClusterConfig], Optional[int]]:
    """The cluster each trial trains on, with its address resolved, and its CPU count; (None, None)
    without one. Connecting here first means the trials' launches share this one connection."""
    if p.cluster is None:
        return None, None
    address = ray_address(p.cluster)
    if not address:
        raise ValueError("a sweep on Ray needs a running cluster: set cluster.address or RAY_ADDRESS "
                         "(NEEDLE_RAY=1 deployments/stack-up.sh starts a local one)")  # fmt: skip
    cluster = p.cluster.model_copy(update={"address": address})
    connect_ray(cluster)
    import ray

    return cluster, int(ray.cluster_resources().get("CPU", 1))


@flow(name="needle", log_prints=True)
def needle_sweep(params: SweepParams = SweepParams()) -> dict[str, Any]:
    """Run an Optuna study, each trial a child MLflow run; gate and register the best trial's model."""
    logging.getLogger("needle").setLevel(logging.INFO)
    redact_logs()
    state = state_dir()
    run = rec.start_run(tracking_uri(state))
    tracker = MlflowTracker(run.run_id, run.uri, terminate_on_finish=False)
    try:
        out = run_sweep(params, state, run, tracker)
    except BaseException as exc:
        rec.end_failed(run, tracker, exc)
        raise
    return rec.end_finished(run, tracker, out)


def run_sweep(p: SweepParams, state: Path, run: rec.MlflowRun, tracker: MlflowTracker) -> dict[str, Any]:
    import optuna

    b = p.base
    source = validate(resolve_source(b.data), b.on_error)
    gate_rows = validate(resolve_source(b.gate_data), "fail")
    hw = probe()
    cluster, cluster_cpus = join_cluster(p)
    jobs = n_parallel(p, cluster_cpus)
    tracker.log_params({"sweep.space": json.dumps({k: v.model_dump(exclude_none=True) for k, v in p.space.items()}),
                        "sweep.sampler": p.sampler, "sweep.n_trials": p.n_trials, "sweep.objective": p.objective,
                        "sweep.n_jobs": jobs, "sweep.seed": p.seed, "flow.data": b.data,
                        "sweep.cluster": cluster.address if cluster else "none"})  # fmt: skip
    tracker.set_tags({"sweep": "parent", "backend": hw["backend"]})
    sweep_dir = state / "sweeps" / str(runtime.flow_run.id or "local")
    direction = "maximize" if p.objective == "exact_match" else "minimize"
    if p.sampler == "grid":
        sampler: Any = optuna.samplers.GridSampler({k: d.choices for k, d in p.space.items()}, seed=p.seed)
    else:
        sampler = optuna.samplers.TPESampler(seed=p.seed)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study_name = f"needle-sweep-{run.run_id}"
    tracker.log_params({"sweep.study": study_name, "sweep.storage": redact_uri(p.storage) if p.storage else "memory"})
    study = optuna.create_study(direction=direction, sampler=sampler, study_name=study_name, storage=p.storage)
    results: dict[int, dict[str, Any]] = {}

    def objective(trial: Any) -> float:
        values = {name: dim.suggest(trial, name) for name, dim in p.space.items()}
        child = _child_run(run, trial.number, values)
        results[trial.number] = {"run_id": child.run_id, "values": values}
        value, trained = run_trial(p, values, child, source, hw, state, sweep_dir / f"trial-{trial.number}", cluster)
        results[trial.number].update(value=value, trained=trained)
        return value

    # catch=Exception: a failed trial is recorded (FAILED child, study state FAIL) and the sweep goes on.
    study.optimize(objective, n_trials=p.n_trials, n_jobs=jobs, catch=(Exception,))
    trials = _trial_rows(study, results)
    complete = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    plot = plot_objective(trials, p.objective, sweep_dir / "plots" / "objective.png")
    tracker.log_artifact(plot, "plots")
    (sweep_dir / "trials.json").write_text(json.dumps(trials, indent=2, default=str) + "\n")
    tracker.log_artifact(sweep_dir / "trials.json", "sweep")
    create_table_artifact(key=TRIALS_KEY, table=trials, description=f"{len(complete)} of {len(trials)} trials "
                          f"complete; objective {p.objective} ({direction})")  # fmt: skip
    tracker.set_tags({"sweep.n_complete": len(complete), "sweep.n_failed": len(trials) - len(complete)})
    if not complete:
        raise RuntimeError(f"all {len(trials)} trials failed: see the FAILED child runs of {run.run_id}")
    best = study.best_trial
    best_res = results[best.number]
    tracker.log_metrics({f"best_{p.objective}": float(best.value)}, step=0)
    tracker.set_tags({"sweep.best_trial": best.number, "sweep.best_run_id": best_res["run_id"],
                      "sweep.best_params": json.dumps(best.params)})  # fmt: skip
    tracker.log_params({f"best.{k}": v for k, v in best.params.items()})
    best_params = p.trial_params(best_res["values"])
    inputs = fingerprint(resolve_source(best_params.data), best_params.on_error,
                         resolve_source(best_params.base_model) if best_params.base_model != "auto" else "auto",
                         best_params.auto_base(), best_params.training_identity())  # fmt: skip
    outcome, version = gate_and_register(best_params, state, run, tracker, best_res["trained"], gate_rows, sweep_dir,
                                         {**inputs, "sweep.parent_run_id": run.run_id, "sweep.trial": best.number},
                                         model_run_id=best_res["run_id"])  # fmt: skip
    print(f"best trial {best.number} ({best.params}): {p.objective} {best.value:.4f}; {outcome.decision.label}")
    return {"hw": hw, "metrics": {f"best_{p.objective}": float(best.value)}, "model_version": version,
            "model_dir": best_res["trained"].model_dir, "decision": outcome.decision.label, "best_trial": best.number,
            "best_params": best.params, "best_run_id": best_res["run_id"], "trials": trials}  # fmt: skip


def _child_run(parent: rec.MlflowRun, number: int, values: dict[str, Any]) -> rec.MlflowRun:
    """A child MLflow run of the sweep's parent run (explicit client: trials run in threads)."""
    child = parent.client.create_run(
        parent.experiment_id, run_name=f"trial-{number}",
        tags={"mlflow.parentRunId": parent.run_id, "sweep.trial": str(number), "sweep.values": json.dumps(values),
              "prefect.flow_run_id": str(runtime.flow_run.id), "git_commit": rec.git_commit()},
    )  # fmt: skip
    return rec.MlflowRun(parent.client, parent.uri, parent.experiment_id, parent.experiment, child.info.run_id)


def run_trial(p: SweepParams, values: dict[str, Any], child: rec.MlflowRun, source: LoadedSource,
              hw: dict[str, Any], state: Path, trial_dir: Path,
              cluster: Optional[ClusterConfig] = None) -> tuple[float, TrainResult]:  # fmt: skip
    """One trial in its child run: the finetune flow's stages, as library calls (trials run in
    threads; with a cluster, training runs on its Ray workers); returns the objective and the
    trained model. Any failure ends the child FAILED."""
    tracker = MlflowTracker(child.run_id, child.uri, terminate_on_finish=True)
    try:
        tp = p.trial_params(values)
        with _BUILD_LOCK:
            base = pipeline.obtain_base(resolve_source(tp.base_model) if tp.base_model != "auto" else "auto",
                                        preset=tp.preset, auto=tp.auto_base(), state_dir=state, tracker=tracker,
                                        max_len=tp.max_len)  # fmt: skip
            data_cfg = tp.data_config(tp.data, base.model_cfg)
            prepared = pipeline.prepare_data(data_cfg, source, tokenizer=base.tokenizer, cache_dir=state / "prepared")
        rec.record_inputs(child, tracker, tp, data_cfg, base, prepared, hw)
        train_cfg, optim_cfg = tp.training_configs()
        key = pipeline.config_digest(prepared.fingerprint, base.model_cfg, train_cfg, optim_cfg, tp.lora, base.model_dir)
        out_dir = state / "finetune" / f"{tp.mode}-{key}"
        with pipeline.build_lock(out_dir, "fine-tune"):
            trained = pipeline.train(prepared, base.model_cfg, train_cfg, optim_cfg, tp.lora, base=base,
                                     out_dir=out_dir, tracker=tracker, cluster=cluster)  # fmt: skip
        report = pipeline.evaluate(base, trained.model_dir, prepared, tp.eval, trial_dir / "eval")
        with _RECORD_LOCK:
            rec.record_results(child, tracker, base, prepared, trained, report, trial_dir, {})
        value = report.tuned.get("exact_match") if p.objective == "exact_match" else trained.val_loss
        if value is None:
            raise ValueError(f"trial has no {p.objective}")
        tracker.log_metrics({"objective": float(value)}, step=trained.final_step)
        tracker.finish("FINISHED")
        return float(value), trained
    except BaseException as exc:
        tracker.set_tags({"failure_reason": redact_uri(f"{type(exc).__name__}: {exc}")[:7900]})
        tracker.finish("FAILED")
        log.warning("trial %s failed: %s: %s", child.run_id, type(exc).__name__, exc)
        raise


def _trial_rows(study: Any, results: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for t in study.trials:
        res = results.get(t.number, {})
        rows.append({"trial": t.number, "state": t.state.name, "value": t.value, "run_id": res.get("run_id"),
                     **{k: json.dumps(v) if isinstance(v, (list, dict)) else v
                        for k, v in (t.params or res.get("values") or {}).items()}})  # fmt: skip
    return rows


def plot_objective(trials: list[dict[str, Any]], objective: str, path: Path) -> Path:
    """The objective of each trial (failed trials marked on the axis) and the best so far."""
    done = [(t["trial"], t["value"]) for t in trials if t["value"] is not None]
    failed = [t["trial"] for t in trials if t["value"] is None]
    fig, ax = rec.new_plot()
    if done:
        xs, ys = zip(*done)
        ax.plot(xs, ys, "o", label=objective)
        better = max if objective == "exact_match" else min
        best = [better(ys[: i + 1]) for i in range(len(ys))]
        ax.step(xs, best, where="post", label="best so far")
    if failed:
        y0 = min((v for _, v in done), default=0.0)
        ax.plot(failed, [y0] * len(failed), "x", color="red", label="failed")
    return rec.save_plot(fig, ax, "trial", objective, path)
