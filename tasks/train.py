"""Prefect task: train (scratch base, LoRA or full) on a prepared dataset, resumable on retry.

``out_dir`` is chosen by the caller from the flow run id and the config, so when Prefect retries
the task (or the flow run is restarted) the training finds its own orbax checkpoints there and
resumes from the latest one instead of starting over.
"""

from pathlib import Path
from typing import Any, Optional

from prefect import task
from prefect.cache_policies import NO_CACHE

from needle.config import LoraConfig, ModelConfig, OptimConfig, TrainConfig


class PrefixedTracker:
    """Puts a prefix on metric and param names, so a base model's training shares a run."""

    def __init__(self, inner: Any, prefix: str) -> None:
        self.inner, self.prefix = inner, prefix

    def log_params(self, params: dict[str, Any]) -> None:
        """Log params under the prefix."""
        self.inner.log_params({self.prefix + k: v for k, v in params.items()})

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Log metrics under the prefix."""
        self.inner.log_metrics({self.prefix + k: v for k, v in metrics.items()}, step)

    def log_artifact(self, path: str | Path, artifact_path: Optional[str] = None) -> None:
        """Log an artifact under the prefix folder."""
        self.inner.log_artifact(path, self.prefix.rstrip("/.") + (f"/{artifact_path}" if artifact_path else ""))

    def set_tags(self, tags: dict[str, Any]) -> None:
        """Set tags under the prefix."""
        self.inner.set_tags({self.prefix + k: v for k, v in tags.items()})

    def finish(self, status: str = "FINISHED") -> None:
        """Flush the inner tracker."""
        self.inner.finish(status)


def make_tracker(run_id: Optional[str], tracking_uri: Optional[str], prefix: str = "") -> Any:
    """An MlflowTracker on the flow's run (the flow ends the run, not the tracker), or a no-op."""
    from needle.tracking import MlflowTracker, NoopTracker

    if not run_id:
        return NoopTracker()
    tracker = MlflowTracker(run_id, tracking_uri, terminate_on_finish=False)
    return PrefixedTracker(tracker, prefix) if prefix else tracker


@task(name="finetune", retries=1, retry_delay_seconds=1, cache_policy=NO_CACHE)
def finetune(
    prepared_dir: str,
    model_cfg: ModelConfig,
    train_cfg: TrainConfig,
    optim_cfg: OptimConfig,
    lora: Optional[LoraConfig],
    base_model_dir: Optional[str],
    out_dir: str,
    run_id: Optional[str] = None,
    tracking_uri: Optional[str] = None,
    metric_prefix: str = "",
) -> dict[str, Any]:
    """Train with needle.train.finetune.run_training; return the model dir, losses and history."""
    from needle.data.prepare import PreparedData
    from needle.tokenizer import Tokenizer
    from needle.train.finetune import run_training

    from tasks.prepare import TOKENIZER_SUBDIR

    prepared = PreparedData.load(prepared_dir)
    tokenizer = Tokenizer.load(Path(prepared_dir) / TOKENIZER_SUBDIR)
    tracker = make_tracker(run_id, tracking_uri, metric_prefix)
    try:
        result = run_training(
            prepared,
            tokenizer,
            model_cfg,
            train_cfg,
            optim_cfg,
            lora if train_cfg.mode == "lora" else None,
            base_model_dir=base_model_dir,
            out_dir=Path(out_dir),
            tracker=tracker,
        )
    finally:
        tracker.finish()  # flushes buffered metrics; the run itself stays open
    return {
        "model_dir": str(result.model_dir),
        "final_step": result.final_step,
        "train_loss": result.train_loss,
        "val_loss": result.val_loss,
        "wall_s": result.wall_s,
        "tokens_per_s": result.tokens_per_s,
        "history": list(result.history),
        "fingerprint": prepared.fingerprint,
    }
