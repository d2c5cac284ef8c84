"""The parameters of the `needle` flow: one validated pydantic model, nested needle configs.

Prefect validates a deployment run's parameters against this model before the run starts, and
the nested configs reject unknown keys, so a typo (``--param params='{"lora": {"rnak": 8}}'``)
is refused instead of silently ignored.

    from needle_flows.params import FinetuneParams
    FinetuneParams(preset="tiny", steps=5, lora={"rank": 4})
"""

# No `from __future__ import annotations`: Prefect resolves this model's annotations at run
# time, and postponed annotations make it "not fully defined" in some run paths.

from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from needle_flows.paths import resolve_source
from needle.config import ClusterConfig, DataConfig, EvalConfig, LoraConfig, ModelConfig, OptimConfig, TrainConfig
from needle.config import data_config, preset_names, training_configs
from needle.gate import DEFAULT_GATE, GateRule
from needle.pipeline import AutoBase, model_config

SAMPLE_NEW = "data/sample/new.jsonl"
SAMPLE_BASE = "data/sample/base.jsonl"
# Fields that do not change the model a run trains: left out of its inputs key (train_key).
# (The base enters the key by content: needle.lineage.base_fingerprint.)
NOT_TRAINING = {"data", "base_data", "base_model", "eval", "register_model", "force", "gate_data", "gate", "cluster"}


class FinetuneParams(BaseModel):
    """Everything one fine-tuning run needs; defaults train on the bundled sample data."""

    model_config = ConfigDict(extra="forbid")

    data: str = Field(
        SAMPLE_NEW, description="rows to fine-tune on: a JSONL file, a folder of them (a landing folder), a glob, "
                                "or a hub id owner/name[@revision]")
    base_model: str = Field(
        "auto", description="a needle or Hugging Face model directory, hf:owner/name[@revision], a .gguf file, "
        "or 'auto': train one (mode scratch) on base_data, once"
    )
    base_data: str = Field(SAMPLE_BASE, description="rows for the 'auto' base model")
    base_steps: Optional[int] = Field(None, gt=0, description="optimizer steps of the 'auto' base (None: the scratch default)")
    preset: Optional[str] = Field(
        None, description="model preset: of the 'auto' base (None: small), or checked against a base directory's"
    )
    mode: Literal["lora", "full"] = Field("lora", description="lora: adapters on a frozen base; full: all weights")
    steps: Optional[int] = Field(None, gt=0, description="fine-tuning steps (None: the mode's default)")
    batch_size: Optional[int] = Field(None, gt=0, description="sequences per step (None: the mode's default)")
    seed: int = Field(0, description="seed for init, shuffling and the base model")
    on_error: Literal["fail", "drop"] = Field("fail", description="bad rows: fail with file:line, or drop and report")
    max_len: Optional[int] = Field(
        None, gt=8, description="longest tokenized row, and an imported base's context (None: the model's max_len; "
        "2048 for an imported base, capped by the model), as `needle train --max-len`"
    )
    lora: LoraConfig = Field(default_factory=LoraConfig, description="adapter settings (mode lora)")
    optim: Optional[OptimConfig] = Field(None, description="optimizer settings (keys not set: the mode's defaults)")
    train: dict[str, Any] = Field(
        default_factory=dict, description="further TrainConfig keys, e.g. log_every, checkpoint_every"
    )
    eval: EvalConfig = Field(default_factory=EvalConfig, description="generation-based evaluation settings")
    cluster: ClusterConfig = Field(
        default_factory=ClusterConfig, description="where the fine-tune trains: in the flow's process, or as one "
        "program on Ray workers (workers, address, devices_per_worker)"
    )
    register_model: bool = Field(True, description="create a model version in the MLflow registry")
    force: bool = Field(False, description="retrain even when data, base and config equal the champion's")
    gate_data: str = Field(DEFAULT_GATE, description="the fixed gate set champion and challenger are scored on")
    gate: GateRule = Field(default_factory=GateRule, description="the promotion rule and its thresholds")

    @field_validator("preset")
    @classmethod
    def _known_preset(cls, value: Optional[str]) -> Optional[str]:
        if value is not None and value not in preset_names():
            raise ValueError(f"unknown preset {value!r}; choose one of {preset_names()}")
        return value

    @model_validator(mode="after")
    def _check_configs(self) -> "FinetuneParams":
        # Build the configs once here so bad keys fail at submission, not mid-run.
        self.training_configs()
        return self

    def training_configs(self) -> tuple[TrainConfig, OptimConfig]:
        """The fine-tuning's train and optimizer configs: the mode's defaults and these overrides."""
        optim = self.optim.model_dump(exclude_unset=True) if self.optim is not None else {}
        return training_configs(self.mode, steps=self.steps, batch_size=self.batch_size, seed=self.seed,
                                train=self.train, optim=optim)  # fmt: skip

    def data_config(self, source: str, model_cfg: ModelConfig) -> DataConfig:
        """How rows of ``source`` are prepared for a model of ``model_cfg``."""
        return data_config(resolve_source(source), model_cfg, self.max_len, self.on_error)

    def training_identity(self) -> dict[str, Any]:
        """The parameters that decide the trained model besides data and base (for train_key)."""
        return self.model_dump(mode="json", exclude=NOT_TRAINING)

    def auto_base(self) -> AutoBase:
        """The 'auto' base: scratch on base_data, the same shortcuts but its own step count."""
        model_cfg = model_config(self.preset)
        train = {k: v for k, v in self.train.items() if k != "steps"}
        train_cfg, optim_cfg = training_configs("scratch", steps=self.base_steps, batch_size=self.batch_size,
                                                seed=self.seed, train=train)  # fmt: skip
        return AutoBase(self.data_config(self.base_data, model_cfg), model_cfg, train_cfg, optim_cfg)
