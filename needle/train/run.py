"""Library entry point for one training run: build, resume, train, export.

``run_training`` is what the pipeline's ``train`` stage calls. By ``train_cfg.mode``:
``scratch`` initialises a model randomly; ``full`` trains every weight of a base model;
``lora`` trains adapters on a frozen base (both take the base as a ``LoadedModel`` in ``base``,
or load ``base_model_dir`` with ``needle.model.io.load_model``). Checkpoints go to
``out_dir/checkpoints`` and a rerun with the same configs and data resumes from the newest one
(a different config or dataset is refused). The merged model is exported to ``out_dir/model``
with ``save_model``. The steps, each a function below: build the state, the resume record
(``resume_meta``), the batch plans, the logged params, train with checkpoint and metrics hooks
(``train_with_checkpoints``), export.

    from needle.train.run import run_training
    result = run_training(prepared, tok, model_cfg, train_cfg, optim_cfg, lora_cfg,
                          base_model_dir="runs/base/model", out_dir="runs/tuned")
"""

from __future__ import annotations

import hashlib
import logging
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from needle.config import LoraConfig, ModelConfig, OptimConfig, TrainConfig, flatten_config, lora_config
from needle.data.batching import BatchPlan, PackedPlan, choose_seq_len
from needle.data.prepare import PreparedData
from needle.errors import NonFiniteLossError
from needle.hardware import BackendSettings, enable_compilation_cache, settings_for, settings_for_model, with_overrides
from needle.model import lora as lora_lib
from needle.model.factory import LoadedModel, module_for
from needle.model.io import load_model, save_model
from needle.model.layout import TOKENIZER_FILES
from needle.model.decoder.scan import stack_model_layers, unstack_layers
from needle.model.decoder.transformer import Transformer
from needle.tokenizers.native import Tokenizer
from needle.tracking.tracker import NoopTracker, Tracker
from needle.train.checkpoint import Checkpointer, build_meta
from needle.train.distributed import is_primary
from needle.train.loop import TrainResult, checkpoint_hook, metrics_hook, train
from needle.train.sharding import data_size, fetch, make_mesh
from needle.train.step import ApplyFn, TrainState, create_state

log = logging.getLogger(__name__)
Plan = BatchPlan | PackedPlan

# TrainConfig fields that only set the cadence of hooks or where caches live: changing them
# between a run and its resume does not change the trajectory, so they are not compared.
# How a run computes, not what: changing them between a crash and its retry still resumes.
_CADENCE_FIELDS = {"log_every", "eval_every", "checkpoint_every", "keep_checkpoints", "compilation_cache_dir",
                   "remat", "attention", "loss_chunk", "micro_batch_tokens"}  # fmt: skip


@dataclass(frozen=True)
class ModelApply:
    """``apply_fn(trainable, frozen, inputs) -> logits``; equal models give equal (hashable) fns."""

    model: Any  # the family's Flax module (needle.model.factory.module_for)

    def __call__(
        self, trainable: Any, frozen: Any, inputs: jax.Array, positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
    ) -> jax.Array:  # fmt: skip
        params = {"params": lora_lib.combine(trainable, frozen)}
        if segment_ids is None and positions is None:
            return self.model.apply(params, inputs)
        return self.model.apply(params, inputs, positions, segment_ids=segment_ids)


def make_apply_fn(model: Any) -> ApplyFn:
    """The ``TrainState.apply_fn`` of a model."""
    return ModelApply(model)


def initial_params(
    model_cfg: ModelConfig,
    train_cfg: TrainConfig,
    lora_cfg: LoraConfig | None,
    base: str | Path | LoadedModel | None,
    settings: BackendSettings,
) -> Any:
    """Starting params for the mode: random (scratch), the base (full), base + fresh adapters (lora).

    ``base`` is the base model's directory or the ``LoadedModel`` already read from it; its
    arrays are copied, since training donates (frees) the state's buffers.
    """
    mode = train_cfg.mode
    if mode == "scratch":
        return lora_lib.init_params(model_cfg, None, train_cfg.seed, settings)
    if base is None:
        raise ValueError(f"mode {mode!r} trains on top of a base model: pass base_model_dir")
    loaded = base if isinstance(base, LoadedModel) else load_model(base)
    ours, theirs = model_cfg.model_dump(exclude={"preset"}), loaded.model_cfg.model_dump(exclude={"preset"})
    differing = sorted(k for k in ours if ours[k] != theirs[k])
    if differing:
        raise ValueError(
            f"model config differs from the base model at {base} in {differing}; "
            "pass the base's config (load_model(dir).model_cfg)"
        )
    base_params = jax.tree.map(jnp.copy, loaded.params) if loaded is base else loaded.params
    if mode == "full":
        return base_params
    if lora_cfg is None:
        raise ValueError("mode 'lora' needs a LoraConfig")
    fresh = lora_lib.init_adapters(model_cfg, lora_cfg, train_cfg.seed, settings)
    return lora_lib.attach_base(fresh, base_params)


def attention_ratio(model_cfg: ModelConfig | None) -> float:
    """A token's dense multiply-adds (projections, MLP, output head) over its attention
    multiply-adds per attended position: what one more slot of sequence length costs."""
    if model_cfg is None:
        return 1024.0
    c, hd = model_cfg, model_cfg.head_dim
    per_layer = c.d_model * hd * (2 * c.n_heads + 2 * c.n_kv_heads) + 3 * c.d_model * c.d_ff
    dense = c.n_layers * per_layer + c.d_model * c.vocab_size
    return dense / (c.n_layers * 2 * c.n_heads * hd)


def make_plans(
    prepared: PreparedData, train_cfg: TrainConfig, max_len: int, pad_id: int, model_cfg: ModelConfig | None = None
) -> tuple[Plan, Plan | None]:
    """The training plan and, when the split has rows, the validation plan.

    With ``train_cfg.packing`` (the default) both are ``PackedPlan`` of one sequence length:
    one compiled training program per run. ``train_cfg.seq_len``, or else the length between the
    longest row and ``2 * max_len`` of least compute per real token (``choose_seq_len``, with the
    model's ``attention_ratio``). A row longer than the model's ``max_len`` is refused here
    (prepare refuses or drops it earlier).
    """
    if "train" not in prepared.splits or not len(prepared.splits["train"]):
        raise ValueError(f"prepared data {prepared.fingerprint} has no training rows")
    val = prepared.splits.get("val")
    splits = [prepared.splits["train"], *([val] if val is not None and len(val) else [])]
    if not train_cfg.packing:
        args = (train_cfg.batch_size, max_len, train_cfg.seed, pad_id)
        plans = [BatchPlan(split, *args) for split in splits]
    else:
        longest = max(len(ids) for split in splits for ids in split["ids"])
        if longest > max_len:
            raise ValueError(f"prepared data {prepared.fingerprint} has a row of {longest} tokens, more than the model's max_len={max_len}")
        seq_len = train_cfg.seq_len
        if seq_len is None:
            slots = np.array([len(ids) - 1 for ids in splits[0]["ids"]], dtype=np.int64)
            seq_len = choose_seq_len(slots, 16, 2 * max_len, attention_ratio(model_cfg))
        plans = [PackedPlan(split, train_cfg.batch_size, seq_len, train_cfg.seed, pad_id) for split in splits]
    return plans[0], plans[1] if len(plans) > 1 else None


def _tokenizer_record(tokenizer: Tokenizer, out_dir: Path) -> tuple[str, str]:
    """Where the tokenizer is kept next to the checkpoints, and its content hash.

    Nothing is written under ``out_dir`` here: a refused resume must leave it as it was, so the
    tokenizer is saved (``save_tokenizer``) only once the checkpoints were found to match.
    """
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save(tmp)
        name = next(f for f in TOKENIZER_FILES if (Path(tmp) / f).is_file())  # tokenizer.model for Needle 3
        sha = hashlib.sha256((Path(tmp) / name).read_bytes()).hexdigest()
    return str(out_dir / "tokenizer" / name), sha


def save_tokenizer(tokenizer: Tokenizer, out_dir: Path) -> None:
    """Save the tokenizer next to the checkpoints (``out_dir/tokenizer``)."""
    tokenizer.save(out_dir / "tokenizer")


def build_state(
    model_cfg: ModelConfig,
    train_cfg: TrainConfig,
    optim_cfg: OptimConfig,
    lora_cfg: LoraConfig | None,
    base: str | Path | LoadedModel | None,
    settings: BackendSettings,
    *,
    keep_master: bool = False,
) -> tuple[TrainState, Any]:
    """The fresh train state of the mode (trainable/frozen split, optimizer, RNG) and, with
    ``keep_master``, the frozen base's float32 host copy (:func:`build_state_from_params`)."""
    model = module_for(model_cfg, lora_cfg, settings)
    # The params inline: no reference is held here while they are split, cast and stacked.
    return build_state_from_params(initial_params(model_cfg, train_cfg, lora_cfg, base, settings), model,
                                   train_cfg.mode, optim_cfg, train_cfg.steps, grad_accum=train_cfg.grad_accum,
                                   seed=train_cfg.seed, keep_master=keep_master)  # fmt: skip


def build_state_from_params(
    params: Any, model: Any, mode: str, optim_cfg: OptimConfig, steps: int, *, grad_accum: int = 1, seed: int = 0,
    keep_master: bool = False,
) -> tuple[TrainState, Any]:  # fmt: skip
    """The train state over ``params`` (the ``block_i`` layout) for ``mode``, as training and the
    benchmarks run it: the frozen half (a LoRA base) in the compute dtype, a scanned model's blocks
    stacked. Returns it with, if ``keep_master`` and the cast changed anything, the frozen half's
    float32 copy on the host in the state's layout (the export merges onto it), else None.

    The cast comes before the stacking, so that stacking copies the compute-dtype base; pass
    ``params`` without keeping a reference and no float32 copy is left on the device (Qwen3-1.7B's
    LoRA: 6.9 GB of float32 base, 3.4 GB once cast)."""
    trainable, frozen = lora_lib.split_trainable(params, mode)
    del params
    settings = model.settings or settings_for("cpu")  # a Transformer's own default
    scanned = isinstance(model, Transformer) and settings.scan_layers
    cast = lora_lib.in_compute_dtype(frozen, settings)
    master = None
    if cast is not frozen and keep_master:
        master = jax.tree.map(np.asarray, frozen)
        master = stack_model_layers(master, model.cfg, np.stack) if scanned else master
    frozen = cast
    if scanned:
        # Scanned layers train on stacked blocks (one optimizer leaf per kind of weight, not per
        # layer); checkpoints and exports still read block_i (checkpoint.py, export_model).
        trainable, frozen = stack_model_layers(trainable, model.cfg), stack_model_layers(frozen, model.cfg)
    state = create_state(make_apply_fn(model), trainable, frozen, optim_cfg, steps, grad_accum=grad_accum, seed=seed)
    return state, master


def resume_meta(
    prepared: PreparedData,
    tokenizer: Tokenizer,
    configs: tuple[ModelConfig, TrainConfig, OptimConfig, LoraConfig | None],
    out: Path,
) -> dict[str, Any]:
    """What a checkpoint in ``out`` must match to be resumed: data, configs (no cadences), tokenizer."""
    model_cfg, train_cfg, optim_cfg, lora_cfg = configs
    tok_path, tok_sha = _tokenizer_record(tokenizer, out)
    named = {
        "model": model_cfg.model_dump(mode="json", exclude={"preset"}),
        "train": train_cfg.model_dump(mode="json", exclude=_CADENCE_FIELDS),
        "optim": optim_cfg,
        "lora": lora_cfg,
    }
    return build_meta(fingerprint=prepared.fingerprint, configs=named, tokenizer_sha256=tok_sha, tokenizer_path=tok_path)


def run_params(
    configs: tuple[ModelConfig, TrainConfig, OptimConfig, LoraConfig | None],
    prepared: PreparedData,
    state: TrainState,
    n_rows: int,
    devices: int,
    backend: str,
    plan: Plan | None = None,
) -> dict[str, Any]:
    """The run's params for the tracker: flattened configs, data and parameter counts, devices,
    and (``plan`` packed) the sequence length and packing efficiency (real tokens / slots)."""
    model_cfg, train_cfg, optim_cfg, lora_cfg = configs
    packed = {}
    if isinstance(plan, PackedPlan):
        packed = {"data.seq_len": plan.seq_len, "data.packing_efficiency": round(plan.efficiency, 4),
                  "data.steps_per_epoch": plan.steps_per_epoch}  # fmt: skip
    return {**packed, 
        **flatten_config(model_cfg, "model."), **flatten_config(train_cfg, "train."),
        **flatten_config(optim_cfg, "optim."), **(flatten_config(lora_cfg, "lora.") if lora_cfg else {}),
        "data.fingerprint": prepared.fingerprint, "data.train_rows": n_rows,
        "params.trainable": lora_lib.count_params(state.trainable), "params.frozen": lora_lib.count_params(state.frozen),
        "devices": devices, "backend": backend,
    }  # fmt: skip


def train_with_checkpoints(
    state: TrainState,
    plans: tuple[Plan, Plan | None],
    train_cfg: TrainConfig,
    meta: dict[str, Any],
    out: Path,
    tracker: Tracker,
    mesh: Any,
    tokenizer: Tokenizer | None = None,
) -> TrainResult:
    """Resume from the newest matching checkpoint in ``out``, train, checkpoint and log on cadence.

    A checkpoint of another config or dataset is refused (``CheckpointMismatchError``) before
    anything is written; ``tokenizer`` is saved next to the checkpoints once they match.
    """
    ckpt = Checkpointer(out / "checkpoints", keep=train_cfg.keep_checkpoints)
    try:
        restored = ckpt.restore_latest(state, meta)
        start_step = 0
        if restored is not None:
            state, saved_meta = restored
            start_step = int(saved_meta["step"])
            log.info("resuming %s training at step %d of %d", train_cfg.mode, start_step, train_cfg.steps)
        if tokenizer is not None and is_primary():
            save_tokenizer(tokenizer, out)
        hooks = [
            metrics_hook(lambda m, step: tracker.log_metrics(m, step=step), train_cfg.log_every),
            checkpoint_hook(ckpt, meta, train_cfg.checkpoint_every),
        ]
        plan, val_plan = plans
        return train(state, plan, train_cfg, mesh=mesh, hooks=hooks, val_plan=val_plan, start_step=start_step)
    except NonFiniteLossError as err:
        ckpt.wait()
        kept = ckpt.latest_step()
        where = "none was written" if kept is None else f"step {kept} in {ckpt.directory}"
        raise NonFiniteLossError(f"{err}; last good checkpoint: {where}") from None
    finally:
        ckpt.close()


def run_training(
    prepared: PreparedData,
    tokenizer: Tokenizer,
    model_cfg: ModelConfig,
    train_cfg: TrainConfig,
    optim_cfg: OptimConfig,
    lora_cfg: LoraConfig | None = None,
    *,
    base_model_dir: str | Path | None = None,
    base: LoadedModel | None = None,
    out_dir: str | Path,
    tracker: Tracker | None = None,
    settings: BackendSettings | None = None,
) -> TrainResult:
    """Train (resuming if a matching checkpoint exists) and export the merged model.

    ``base`` is the base model already loaded from ``base_model_dir`` (read here when absent).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # Only process 0 reports (several processes run one program: needle/train/distributed.py).
    tracker = tracker if tracker is not None and is_primary() else NoopTracker()
    settings = with_overrides(settings or settings_for_model(jax.default_backend(), model_cfg), train_cfg)
    enable_compilation_cache(train_cfg.compilation_cache_dir)
    if tokenizer.vocab_size > model_cfg.vocab_size:
        raise ValueError(f"tokenizer has {tokenizer.vocab_size} tokens but model vocab_size={model_cfg.vocab_size}")
    lora_cfg = lora_config(train_cfg.mode, lora_cfg)
    configs = (model_cfg, train_cfg, optim_cfg, lora_cfg)
    # The frozen base in the compute dtype; the export merges onto its master copy.
    state, master_frozen = build_state(*configs, base if base is not None else base_model_dir, settings,
                                       keep_master=True)  # fmt: skip
    meta = resume_meta(prepared, tokenizer, configs, out)
    mesh = make_mesh(fsdp=train_cfg.fsdp)
    if train_cfg.batch_size % data_size(mesh):  # fail before any compilation
        raise ValueError(f"batch_size={train_cfg.batch_size} does not divide across {data_size(mesh)} devices")
    plans = make_plans(prepared, train_cfg, model_cfg.max_len, tokenizer.pad_id, model_cfg)
    params = run_params(configs, prepared, state, len(plans[0]), data_size(mesh), settings.backend, plans[0])
    if isinstance(plans[0], PackedPlan):
        log.info("%s: %d rows packed into sequences of %d tokens, efficiency %.3f (real tokens / slots), %d steps per epoch",
                 train_cfg.mode, len(plans[0]), plans[0].seq_len, plans[0].efficiency, plans[0].steps_per_epoch)  # fmt: skip
    tracker.log_params(params)
    result = train_with_checkpoints(state, plans, train_cfg, meta, out, tracker, mesh, tokenizer)
    assert result.state is not None
    export_meta = {
        "mode": train_cfg.mode, "fingerprint": prepared.fingerprint, "steps": result.final_step, "seed": train_cfg.seed,
        "train_loss": result.train_loss, "val_loss": result.val_loss,
        "base_model_dir": None if base_model_dir is None else str(base_model_dir),
        "lora": None if lora_cfg is None else lora_cfg.model_dump(mode="json"),
        # An imported base's source, revision, architecture and size (a PEFT export names it).
        "base": (base.meta.get("base") if base is not None else None),
    }  # fmt: skip
    model_dir = export_model(result.state, out / "model", model_cfg, lora_cfg, tokenizer, export_meta, master_frozen)
    return replace(result, model_dir=str(model_dir), state=None, params=params)


def export_model(
    state: TrainState,
    model_dir: Path,
    model_cfg: ModelConfig,
    lora_cfg: LoraConfig | None,
    tokenizer: Tokenizer,
    meta: dict[str, Any],
    frozen: Any = None,
) -> Path:
    """Write the trained model in base layout (adapters merged) for eval, predict and the registry.

    ``frozen`` is the base in its master dtype when the state holds a compute-dtype copy."""
    # Every process gathers (a collective); process 0 alone writes.
    params = unstack_layers(fetch(lora_lib.combine(state.trainable, state.frozen if frozen is None else frozen)))
    adapter = None
    if lora_cfg is not None:
        adapter = unstack_layers(fetch(state.trainable))  # kept unmerged too, for a PEFT export
        params = lora_lib.merge_lora(params, lora_cfg)
    # Host arrays: orbax refuses a single-device jax.Array once several processes are in the program.
    params = jax.tree.map(np.asarray, params)
    if is_primary():
        save_model(model_dir, params, model_cfg, tokenizer, meta, adapter=adapter)
    return model_dir
