"""Library entry point for one training run: build, resume, train, export.

``run_training`` is what the Prefect task and the CLI call. By ``train_cfg.mode``:
``scratch`` initialises a model randomly; ``full`` trains every weight of a base model;
``lora`` trains adapters on a frozen base (both load ``base_model_dir`` with
``needle.model.io.load_model``). Checkpoints go to ``out_dir/checkpoints`` and a rerun with
the same configs and data resumes from the newest one (a different config or dataset is
refused). The merged model is exported to ``out_dir/model`` with ``save_model``.

    from needle.train.finetune import run_training
    result = run_training(prepared, tok, model_cfg, train_cfg, optim_cfg, lora_cfg,
                          base_model_dir="runs/base/model", out_dir="runs/tuned")
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import jax

from needle.config import LoraConfig, ModelConfig, OptimConfig, TrainConfig, flatten_config
from needle.data.batching import BatchPlan
from needle.data.prepare import PreparedData
from needle.hardware import BackendSettings, enable_compilation_cache, settings_for
from needle.model import lora as lora_lib
from needle.model.io import load_model, save_model
from needle.model.transformer import Transformer
from needle.tokenizer import Tokenizer
from needle.tracking import NoopTracker, Tracker
from needle.train.checkpoint import Checkpointer, build_meta
from needle.train.loop import TrainResult, checkpoint_hook, metrics_hook, train
from needle.train.sharding import data_size, make_mesh
from needle.train.step import ApplyFn, TrainState, create_state

log = logging.getLogger(__name__)

# TrainConfig fields that only set the cadence of hooks or where caches live: changing them
# between a run and its resume does not change the trajectory, so they are not compared.
_CADENCE_FIELDS = {"log_every", "eval_every", "checkpoint_every", "keep_checkpoints", "compilation_cache_dir"}


@dataclass(frozen=True)
class ModelApply:
    """``apply_fn(trainable, frozen, inputs) -> logits``; equal models give equal (hashable) fns."""

    model: Transformer

    def __call__(self, trainable: Any, frozen: Any, inputs: jax.Array) -> jax.Array:
        return self.model.apply({"params": lora_lib.combine(trainable, frozen)}, inputs)


def make_apply_fn(model: Transformer) -> ApplyFn:
    """The ``TrainState.apply_fn`` of a model."""
    return ModelApply(model)


def initial_params(
    model_cfg: ModelConfig,
    train_cfg: TrainConfig,
    lora_cfg: LoraConfig | None,
    base_model_dir: str | Path | None,
    settings: BackendSettings,
) -> Any:
    """Starting params for the mode: random (scratch), the base (full), base + fresh adapters (lora)."""
    mode = train_cfg.mode
    if mode == "scratch":
        return lora_lib.init_params(model_cfg, None, train_cfg.seed, settings)
    if base_model_dir is None:
        raise ValueError(f"mode {mode!r} trains on top of a base model: pass base_model_dir")
    base = load_model(base_model_dir)
    ours, theirs = model_cfg.model_dump(exclude={"preset"}), base.model_cfg.model_dump(exclude={"preset"})
    differing = sorted(k for k in ours if ours[k] != theirs[k])
    if differing:
        raise ValueError(
            f"model config differs from the base model at {base_model_dir} in {differing}; "
            "pass the base's config (load_model(dir).model_cfg)"
        )
    if mode == "full":
        return base.params
    if lora_cfg is None:
        raise ValueError("mode 'lora' needs a LoraConfig")
    fresh = lora_lib.init_params(model_cfg, lora_cfg, train_cfg.seed, settings)
    return lora_lib.attach_base(fresh, base.params)


def make_plans(
    prepared: PreparedData, train_cfg: TrainConfig, max_len: int, pad_id: int
) -> tuple[BatchPlan, BatchPlan | None]:
    """The training plan and, when the split has rows, the validation plan."""
    if "train" not in prepared.splits or not len(prepared.splits["train"]):
        raise ValueError(f"prepared data {prepared.fingerprint} has no training rows")
    args = (train_cfg.batch_size, max_len, train_cfg.seed, pad_id)
    val = prepared.splits.get("val")
    return BatchPlan(prepared.splits["train"], *args), BatchPlan(val, *args) if val is not None and len(val) else None


def _tokenizer_record(tokenizer: Tokenizer, out_dir: Path) -> tuple[str, str]:
    """Save the tokenizer next to the checkpoints; return its path and content hash."""
    tok_dir = out_dir / "tokenizer"
    tokenizer.save(tok_dir)
    path = tok_dir / "tokenizer.json"
    return str(path), hashlib.sha256(path.read_bytes()).hexdigest()


def run_training(
    prepared: PreparedData,
    tokenizer: Tokenizer,
    model_cfg: ModelConfig,
    train_cfg: TrainConfig,
    optim_cfg: OptimConfig,
    lora_cfg: LoraConfig | None = None,
    *,
    base_model_dir: str | Path | None = None,
    out_dir: str | Path,
    tracker: Tracker | None = None,
    settings: BackendSettings | None = None,
) -> TrainResult:
    """Train (resuming if a matching checkpoint exists) and export the merged model."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tracker = tracker or NoopTracker()
    settings = settings or settings_for(jax.default_backend())
    enable_compilation_cache(train_cfg.compilation_cache_dir)
    if tokenizer.vocab_size > model_cfg.vocab_size:
        raise ValueError(f"tokenizer has {tokenizer.vocab_size} tokens but model vocab_size={model_cfg.vocab_size}")
    lora_cfg = lora_cfg if train_cfg.mode == "lora" else None

    params = initial_params(model_cfg, train_cfg, lora_cfg, base_model_dir, settings)
    trainable, frozen = lora_lib.split_trainable(params, train_cfg.mode)
    model = Transformer(model_cfg, lora_cfg, settings)
    state = create_state(
        make_apply_fn(model), trainable, frozen, optim_cfg, train_cfg.steps,
        grad_accum=train_cfg.grad_accum, seed=train_cfg.seed,
    )  # fmt: skip

    tok_path, tok_sha = _tokenizer_record(tokenizer, out)
    configs = {
        "model": model_cfg.model_dump(mode="json", exclude={"preset"}),
        "train": train_cfg.model_dump(mode="json", exclude=_CADENCE_FIELDS),
        "optim": optim_cfg,
        "lora": lora_cfg,
    }
    meta = build_meta(fingerprint=prepared.fingerprint, configs=configs, tokenizer_sha256=tok_sha, tokenizer_path=tok_path)
    mesh = make_mesh()
    if train_cfg.batch_size % data_size(mesh):  # fail before any compilation
        raise ValueError(f"batch_size={train_cfg.batch_size} does not divide across {data_size(mesh)} devices")
    plan, val_plan = make_plans(prepared, train_cfg, model_cfg.max_len, tokenizer.pad_id)

    tracker.log_params({
        **flatten_config(model_cfg, "model."), **flatten_config(train_cfg, "train."),
        **flatten_config(optim_cfg, "optim."), **(flatten_config(lora_cfg, "lora.") if lora_cfg else {}),
        "data.fingerprint": prepared.fingerprint, "data.train_rows": len(plan),
        "params.trainable": lora_lib.count_params(trainable), "params.frozen": lora_lib.count_params(frozen),
        "devices": data_size(mesh), "backend": settings.backend,
    })  # fmt: skip

    ckpt = Checkpointer(out / "checkpoints", keep=train_cfg.keep_checkpoints)
    try:
        restored = ckpt.restore_latest(state, meta)
        start_step = 0
        if restored is not None:
            state, saved_meta = restored
            start_step = int(saved_meta["step"])
            log.info("resuming %s training at step %d of %d", train_cfg.mode, start_step, train_cfg.steps)
        hooks = [
            metrics_hook(lambda m, step: tracker.log_metrics(m, step=step), train_cfg.log_every),
            checkpoint_hook(ckpt, meta, train_cfg.checkpoint_every),
        ]
        result = train(state, plan, train_cfg, mesh=mesh, hooks=hooks, val_plan=val_plan, start_step=start_step)
    finally:
        ckpt.close()
    assert result.state is not None
    export_meta = {
        "mode": train_cfg.mode, "fingerprint": prepared.fingerprint, "steps": result.final_step,
        "train_loss": result.train_loss, "val_loss": result.val_loss,
        "base_model_dir": None if base_model_dir is None else str(base_model_dir),
        "lora": None if lora_cfg is None else lora_cfg.model_dump(mode="json"),
    }  # fmt: skip
    model_dir = export_model(result.state, out / "model", model_cfg, lora_cfg, tokenizer, export_meta)
    return replace(result, model_dir=str(model_dir), state=None)


def export_model(
    state: TrainState,
    model_dir: Path,
    model_cfg: ModelConfig,
    lora_cfg: LoraConfig | None,
    tokenizer: Tokenizer,
    meta: dict[str, Any],
) -> Path:
    """Write the trained model in base layout (adapters merged) for eval, predict and the registry."""
    params = jax.device_get(lora_lib.combine(state.trainable, state.frozen))
    if lora_cfg is not None:
        params = lora_lib.merge_lora(params, lora_cfg)
    save_model(model_dir, params, model_cfg, tokenizer, meta)
    return model_dir
