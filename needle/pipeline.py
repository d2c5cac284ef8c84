"""The pipeline: plain, typed stages over needle configs. Every entry point composes these.

`needle train`, the benchmark and the Prefect flow (one Prefect task per stage) call the same
functions, so there is one path from a JSONL file to a registered model::

    source   = load_data(path, on_error)                     # read and validate, once per run
    base     = obtain_base("auto" | model_dir, preset=..., auto=AutoBase(...), state_dir=...)
    prepared = prepare_data(data_cfg, source, tokenizer=base.tokenizer, cache_dir=...)
    trained  = train(prepared, base.model_cfg, train_cfg, optim_cfg, lora_cfg, base=base, out_dir=...)
    report   = evaluate(base, trained.model_dir, prepared, eval_cfg, out_dir)
    gate     = score_models({"challenger": trained.model_dir, "champion": champion_dir}, gate_rows, eval_cfg, out)

Stages take configs and earlier stages' results and return frozen dataclasses; they write only
under the directories they are given and report through a ``Tracker``. Nothing here imports
Prefect or the shell; MLflow is reached only through ``needle.tracking.tracker``/``needle.registry``.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from needle.config import (
    ClusterConfig, DEFAULT_PRESET, DataConfig, EvalConfig, LoraConfig, ModelConfig, OptimConfig, TrainConfig, model_preset,
)  # fmt: skip
from needle.data.load import LoadedSource, OnError, load_source
from needle.data.prepare import (
    PreparedData, cache_key, collect_texts, load_cached, prepare_rows, save_cached, tokenizer_sha256,
)  # fmt: skip
from needle.eval.evaluate import evaluate_model
from needle.eval.report import compare, summary_of, write_report
from needle.model.factory import LoadedModel
from needle.model.io import load_model
from needle.model.lora import count_params
from needle.registry import decide_registration
from needle.tokenizers.native import Tokenizer, train_tokenizer
from needle.tracking.tracker import NoopTracker, PrefixedTracker, Tracker
from needle.train.run import run_training
from needle.train.launch import TrainSpec, train_on_workers
from needle.train.loop import TrainResult

__all__ = [
    "AutoBase", "Base", "Evaluation", "PreparedSet",
    "load_data", "obtain_base", "prepare_data", "train", "evaluate", "decide_registration",
    "model_config", "config_digest", "replay_record", "auto_base_key", "score_models",
]  # fmt: skip

log = logging.getLogger(__name__)
BASE_PREFIX = "base/"  # tracking keys of the base's own training (base/loss, base/train.steps)
_BASE_RECORD = "base.json"


@dataclass(frozen=True)
class PreparedSet:
    """Tokenized splits and the tokenizer that made them; ``directory`` holds both when saved."""

    data: PreparedData
    tokenizer: Tokenizer
    directory: Path | None
    cached: bool

    @property
    def fingerprint(self) -> str:
        return self.data.fingerprint


@dataclass(frozen=True)
class AutoBase:
    """How the ``auto`` base is trained (mode scratch): on which rows, with which configs."""

    data: DataConfig
    model: ModelConfig
    train: TrainConfig
    optim: OptimConfig


@dataclass(frozen=True)
class Base:
    """The base model, loaded once per run; ``record`` is what training an ``auto`` base logged."""

    spec: str  # what was asked for: "auto" or a model directory
    model_dir: str
    loaded: LoadedModel = field(repr=False)
    cached: bool | None = None  # auto: reused from the cache (True) or trained now (False)
    record: dict[str, Any] | None = None  # auto: {"params", "history", "fingerprint", "model_dir"}

    @property
    def model_cfg(self) -> ModelConfig:
        return self.loaded.model_cfg

    @property
    def tokenizer(self) -> Any:
        return self.loaded.tokenizer

    def describe(self) -> dict[str, Any]:
        """Where the base came from: source (hub id or path), revision, architecture, parameter count."""
        imported = self.loaded.meta.get("base") or {}
        return {"source": imported.get("source", self.model_dir), "revision": imported.get("revision"),
                "arch": self.model_cfg.arch, "n_params": imported.get("n_params") or count_params(self.loaded.params)}


@dataclass(frozen=True)
class Evaluation:
    """Both models scored on the test split: reports under ``report_dir``, the comparison."""

    report_dir: Path
    comparison: dict[str, dict[str, Any]]
    base: dict[str, Any]
    tuned: dict[str, Any]


def load_data(source: str, on_error: OnError = "fail") -> LoadedSource:
    """Read and validate every row of a source once (file:line issues; ``drop`` keeps the good)."""
    return load_source(source, on_error)


def prepare_data(
    cfg: DataConfig,
    source: LoadedSource | None = None,
    *,
    tokenizer: Tokenizer | None = None,
    vocab_size: int | None = None,
    cache_dir: str | Path | None = None,
) -> PreparedSet:
    """Tokenize, split and fingerprint ``source`` (read from ``cfg.source`` when not given).

    With ``tokenizer`` (a base's) the rows are encoded with it; without, a byte-level BPE of
    ``vocab_size`` is trained on them. With ``cache_dir`` the result is saved under a key of the
    input bytes, the config and the tokenizer, and an unchanged dataset is prepared once.
    """
    if tokenizer is None and vocab_size is None:
        raise ValueError("prepare_data needs a tokenizer or the vocab_size of one to train")
    source = source if source is not None else load_data(cfg.source, cfg.on_error)
    tok_id = tokenizer_sha256(tokenizer) if tokenizer is not None else f"train:{vocab_size}"
    directory = Path(cache_dir) / cache_key(source.digest, cfg, tok_id) if cache_dir is not None else None
    hit = load_cached(directory) if directory is not None else None
    if hit is not None:
        log.info("prepared data: reusing %s", directory)
        return PreparedSet(hit[0], hit[1], directory, cached=True)
    if tokenizer is None:
        tokenizer = train_tokenizer(collect_texts(source.rows), vocab_size=vocab_size)
    data = prepare_rows(source, cfg, tokenizer)
    if directory is not None:
        save_cached(data, tokenizer, directory)
    return PreparedSet(data, tokenizer, directory, cached=False)


def obtain_base(
    spec: str,
    *,
    preset: str | None = None,
    auto: AutoBase | None = None,
    state_dir: str | Path | None = None,
    tracker: Tracker | None = None,
    max_len: int | None = None,
) -> Base:
    """The base model: ``"auto"`` trains one (``auto``) once per data and configs under
    ``state_dir/base`` and reuses it after, replaying its logged params and curve into
    ``tracker`` (keys prefixed ``base/``) so every run has the same keys; anything else is loaded
    with ``load_model``: a native export, a Hugging Face model directory or ``hf:owner/name[@rev]``
    (the model config comes from the base; a named ``preset`` must match a native base's;
    ``max_len`` sets an imported model's context, see ``needle.config.imported_max_len``)."""
    if spec != "auto":
        return _load_base(spec, preset, max_len)
    if auto is None or state_dir is None:
        raise ValueError("an 'auto' base needs its AutoBase configs and a state_dir to cache it in")
    if preset and preset != auto.model.preset:
        raise ValueError(f"preset {preset!r} does not match the auto base's preset {auto.model.preset!r}")
    return _auto_base(auto, Path(state_dir), PrefixedTracker(tracker or NoopTracker(), BASE_PREFIX))


def _load_base(model_dir: str, preset: str | None, max_len: int | None = None) -> Base:
    # A native export, a Hugging Face directory or hf:owner/name[@rev] (max_len: HF only).
    loaded = load_model(model_dir, max_len=max_len)
    if preset and preset != loaded.model_cfg.preset:
        raise ValueError(
            f"preset {preset!r} does not match the base model's preset {loaded.model_cfg.preset!r} ({model_dir})"
        )
    return Base(spec=model_dir, model_dir=str(model_dir), loaded=loaded)


def config_digest(*parts: Any) -> str:
    """A short, stable hash of JSON-able parts (configs are hashed by their repr): names run dirs."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def auto_base_key(auto: AutoBase, data_digest: str) -> str:
    """What names an auto base: its rows' content digest and its configs (the cache folder's name)."""
    data_key = auto.data.model_dump(mode="json", exclude={"source"})
    configs = [c.model_dump(mode="json") for c in (auto.model, auto.train, auto.optim)]
    return config_digest(data_digest, data_key, *configs)


def _auto_base(auto: AutoBase, state: Path, tracker: Tracker) -> Base:
    """Train the auto base once per (data bytes, configs); reuse and replay it afterwards.

    A file lock next to the base's folder makes a second run that wants the same base (another
    flow on the same state dir) wait for the first to finish, then reuse what it built.
    """
    source = load_data(auto.data.source, auto.data.on_error)
    base_dir = state / "base" / auto_base_key(auto, source.digest)
    marker = base_dir / _BASE_RECORD
    with build_lock(base_dir, "auto base"):
        cached = _cached_base(marker, tracker)
        if cached is not None:
            return cached
        prepared = prepare_data(auto.data, source, vocab_size=auto.model.vocab_size, cache_dir=state / "prepared")
        trained = train(prepared, auto.model, auto.train, auto.optim, out_dir=base_dir, tracker=tracker)
        record = {"model_dir": trained.model_dir, "fingerprint": prepared.fingerprint,
                  "params": trained.params, "history": trained.history, "prepared_dir": str(prepared.directory)}
        marker.write_text(json.dumps(record, default=str))
    return Base("auto", trained.model_dir, load_model(trained.model_dir), cached=False, record=record)


def _cached_base(marker: Path, tracker: Tracker) -> Base | None:
    """The base recorded in ``marker`` (its params and curve replayed into ``tracker``), if it is there."""
    if not marker.exists():
        return None
    record = json.loads(marker.read_text())
    if not Path(record["model_dir"]).exists():
        return None
    log.info("auto base: reusing %s (trained once for these data and configs)", record["model_dir"])
    replay_record(record, tracker)
    return Base("auto", record["model_dir"], load_model(record["model_dir"]), cached=True, record=record)


@contextmanager
def build_lock(base_dir: Path, what: str = "auto base") -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``<base_dir>.lock``; another holder makes this wait (one line)."""
    base_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(base_dir.with_name(base_dir.name + ".lock"), "a") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("%s: another run is building %s; waiting for it", what, base_dir)
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def replay_record(record: dict[str, Any], tracker: Tracker) -> None:
    """Log a cached base's params and training curve again, as its own training logged them."""
    tracker.log_params(record.get("params", {}))
    for rec in record.get("history", []):
        tracker.log_metrics({k: float(v) for k, v in rec.items() if isinstance(v, (int, float))}, step=int(rec["step"]))


def train(
    prepared: PreparedSet,
    model_cfg: ModelConfig,
    train_cfg: TrainConfig,
    optim_cfg: OptimConfig,
    lora_cfg: LoraConfig | None = None,
    *,
    base: Base | None = None,
    out_dir: str | Path,
    tracker: Tracker | None = None,
    cluster: ClusterConfig | None = None,
) -> TrainResult:
    """Train (scratch, or lora/full on ``base``) and export to ``out_dir/model``; resumes from
    ``out_dir``'s checkpoints when rerun with the same configs and data (a retry).

    ``cluster`` with more than one worker, or an address, trains on Ray workers as one program
    (``needle/train/launch.py``); their params and metrics are logged here when it ends. Returns
    what training returns: ``run_training``'s ``TrainResult`` (``model_dir``, losses, history,
    the logged ``params``), worker 0's on a cluster.
    """
    if cluster is not None and cluster.on_ray:
        result = _train_on_cluster(prepared, model_cfg, train_cfg, optim_cfg, lora_cfg, base, Path(out_dir), cluster)
        replay_record({"params": result.params, "history": result.history}, tracker or NoopTracker())
    else:
        result = run_training(
            prepared.data, prepared.tokenizer, model_cfg, train_cfg, optim_cfg, lora_cfg,
            base_model_dir=base.model_dir if base is not None else None,
            base=base.loaded if base is not None else None,
            out_dir=Path(out_dir), tracker=tracker,
        )  # fmt: skip
    return result


def _train_on_cluster(
    prepared: PreparedSet, model_cfg: ModelConfig, train_cfg: TrainConfig, optim_cfg: OptimConfig,
    lora_cfg: LoraConfig | None, base: Base | None, out: Path, cluster: ClusterConfig,
) -> Any:  # fmt: skip

    directory = prepared.directory
    if directory is None:  # the workers read the prepared data from disk
        directory = save_cached(prepared.data, prepared.tokenizer, out / "prepared")
    spec = TrainSpec(str(directory), model_cfg, train_cfg, optim_cfg, lora_cfg,
                     base.model_dir if base is not None else None, str(out))  # fmt: skip
    return train_on_workers(spec, cluster)


def evaluate(
    base: Base, tuned_model_dir: str, prepared: PreparedSet, cfg: EvalConfig, out_dir: str | Path
) -> Evaluation:
    """Score base and tuned model's tool calls on the test split; write per-model reports and
    ``comparison.json`` under ``out_dir``."""
    split, out = prepared.data.splits["test"], Path(out_dir)
    results = {}
    for name, model in (("base", base.loaded), ("tuned", load_model(tuned_model_dir))):
        results[name] = evaluate_model(model, split, cfg)
        write_report(results[name], out / name)
    comparison = compare(results["base"], results["tuned"])
    (out / "comparison.json").write_text(json.dumps(comparison, indent=2, sort_keys=True) + "\n")
    return Evaluation(out, comparison, summary_of(results["base"]), summary_of(results["tuned"]))


def score_models(
    models: dict[str, str | LoadedModel], rows: LoadedSource | Any, cfg: EvalConfig, out_dir: str | Path
) -> dict[str, dict[str, Any]]:
    """Score each named model on the same rows (a loaded source, or a prepared split, which adds
    the validation loss) with the same decoding settings (``cfg``): the gate's champion and
    challenger, a sweep's trial. Reports under ``out_dir/<name>``; returns each model's summary
    metrics."""
    split = rows.rows if isinstance(rows, LoadedSource) else rows
    scores = {}
    for name, model in models.items():
        result = evaluate_model(model, split, cfg)
        write_report(result, Path(out_dir) / name)
        scores[name] = summary_of(result)
    return scores


def model_config(preset: str | None) -> ModelConfig:
    """The model config of a base trained from scratch: the named preset, or the default one."""
    return model_preset(preset or DEFAULT_PRESET)
