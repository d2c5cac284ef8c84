"""The Prefect tasks: one per pipeline stage, each a one-line call of the stage in needle.pipeline.

Names, retries and cache policy live on the decorators; the logic lives in the library. No task
caches through Prefect (the stages cache their own work on disk: prepared data by content key,
the auto base by digest, training by resumable checkpoints), and a retry is only worth it for
failures that may not happen again: needle's own errors (bad rows, a NaN loss, a mismatched
checkpoint) and config errors are deterministic and fail at once.
"""

import json
from pathlib import Path
from typing import Any, Optional

from prefect import Task, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.client.schemas.objects import TaskRun
from prefect.states import State

from needle import gate as gating
from needle import lineage, pipeline, registry
from needle.config import ClusterConfig, DataConfig, EvalConfig, LoraConfig, OptimConfig, TrainConfig
from needle.data.load import LoadedSource
from needle.errors import NeedleError
from needle.hardware import format_probe
from needle.hardware import probe as probe_runtime
from needle.model.export import export_run_model
from needle.tracking.tracker import Tracker
from needle.train.loop import TrainResult


def transient_only(task: Task, task_run: TaskRun, state: State) -> bool:
    """Prefect's retry condition: retry unless the failure is deterministic."""
    return not isinstance(state.data, (NeedleError, ValueError))


# log_prints off here and in prepare: datasets fingerprints functions with dill, which captures
# dis.dis output from stdout; the flow's log_prints would turn those listings into log lines.
@task(name="validate", cache_policy=NO_CACHE, log_prints=False)
def validate(source: str, on_error: str) -> LoadedSource:
    """Read and validate every row (fails in seconds with file:line, before any training)."""
    return pipeline.load_data(source, on_error)


@task(name="prepare", cache_policy=NO_CACHE, log_prints=False)
def prepare(cfg: DataConfig, source: LoadedSource, tokenizer: Any, cache_dir: Path) -> pipeline.PreparedSet:
    """Tokenize with the base's tokenizer, split, fingerprint; cached by content under cache_dir."""
    return pipeline.prepare_data(cfg, source, tokenizer=tokenizer, cache_dir=cache_dir)


@task(name="base", retries=1, retry_delay_seconds=1, retry_condition_fn=transient_only, cache_policy=NO_CACHE,
      log_prints=False)
def base(spec: str, preset: Optional[str], auto: pipeline.AutoBase, state_dir: Path, tracker: Tracker,
         max_len: Optional[int] = None) -> pipeline.Base:
    """Load the base model, or train the 'auto' one once (resuming on retry) and reuse it after."""
    return pipeline.obtain_base(spec, preset=preset, auto=auto, state_dir=state_dir, tracker=tracker, max_len=max_len)


@task(name="train", retries=1, retry_delay_seconds=1, retry_condition_fn=transient_only, cache_policy=NO_CACHE)
def train(prepared: pipeline.PreparedSet, base: pipeline.Base, train_cfg: TrainConfig, optim_cfg: OptimConfig,
             lora: LoraConfig, out_dir: Path, tracker: Tracker, cluster: Optional[ClusterConfig] = None) -> TrainResult:
    """Fine-tune on the base (on Ray workers with a cluster); out_dir is fixed by data and configs, so a retry or re-run resumes it."""
    with pipeline.build_lock(out_dir, "fine-tune"):  # two flows on one state dir never train one folder at once
        return pipeline.train(prepared, base.model_cfg, train_cfg, optim_cfg, lora, base=base, out_dir=out_dir,
                              tracker=tracker, cluster=cluster)


@task(name="evaluate", cache_policy=NO_CACHE)
def evaluate(base: pipeline.Base, tuned_dir: str, prepared: pipeline.PreparedSet, cfg: EvalConfig,
             out_dir: Path) -> pipeline.Evaluation:
    """Score base and tuned model on the test split; reports and comparison.json under out_dir."""
    return pipeline.evaluate(base, tuned_dir, prepared, cfg, out_dir)


@task(name="export", cache_policy=NO_CACHE)
def export(model_dir: str, out_dir: Path) -> dict[str, Path]:
    """Write the tuned model as a Hugging Face model (and a PEFT adapter for an imported base)."""
    return export_run_model(model_dir, out_dir)


@task(name="fingerprint", cache_policy=NO_CACHE)
def fingerprint(data: str, on_error: str, base_spec: str, auto: pipeline.AutoBase, config: dict[str, Any]) -> dict[str, str]:
    """The run's inputs by content, before anything is loaded: data digest, base, config, train_key."""
    data_digest = lineage.data_digest(data, on_error)
    base = lineage.base_fingerprint(base_spec, auto)
    config_key = pipeline.config_digest(config)
    return {"data_digest": data_digest, **base, "config_key": config_key,
            registry.TRAIN_KEY: lineage.inputs_key(data_digest, base["base_key"], config)}


@task(name="unchanged", cache_policy=NO_CACHE)
def unchanged(tracking_uri: str, train_key: str) -> Optional[dict[str, str]]:
    """The champion (or last challenger) already trained from these inputs, if any."""
    found = registry.unchanged_version(tracking_uri, train_key)
    if found is None:
        return None
    alias, mv = found
    return {"alias": alias, "version": str(mv.version), "run_id": mv.run_id}


@task(name="champion", retries=2, retry_delay_seconds=2, cache_policy=NO_CACHE)
def champion(tracking_uri: str, cache_dir: Path) -> Optional[tuple[str, str]]:
    """``(version, local model dir)`` of the current champion (downloaded once), or None."""
    mv = registry.alias_version(tracking_uri, registry.CHAMPION)
    if mv is None:
        return None
    return str(mv.version), registry.resolve_model_dir(f"models:/{registry.MODEL_NAME}/{mv.version}", cache_dir)


@task(name="gate", cache_policy=NO_CACHE)
def gate(challenger_dir: str, champion: Optional[tuple[str, str]], gate_rows: LoadedSource, cfg: EvalConfig,
         rule: gating.GateRule, out_dir: Path) -> gating.GateOutcome:
    """Score challenger and champion on the gate set with the same settings; apply the rule."""
    return gating.run_gate(challenger_dir, champion, gate_rows, cfg, rule, out_dir)


@task(name="register", cache_policy=NO_CACHE)
def register(run_id: str, tracking_uri: str, tags: dict[str, Any], outcome: gating.GateOutcome) -> dict[str, Any]:
    """A new version of registered model `needle`: alias `champion` if it passed the gate, else `challenger`."""
    return registry.register_version(run_id, tracking_uri, tags, outcome.decision.promote,
                                     champion_version=outcome.champion_version, champion_tags=outcome.champion_tags())


@task(name="probe", cache_policy=NO_CACHE)
def probe() -> dict[str, Any]:
    """Probe the JAX runtime and publish the report as a Prefect artifact."""
    info = probe_runtime()
    create_markdown_artifact(
        key="hardware-probe",
        markdown=f"## Hardware probe\n\n```\n{format_probe(info)}\n```\n\n```json\n{json.dumps(info, indent=2)}\n```\n",
        description=f"JAX backend {info['backend']} with {info['device_count']} device(s)",
    )
    return info
