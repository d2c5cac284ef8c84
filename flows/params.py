"""The parameters of the `needle` flow: one validated pydantic model, nested needle configs.

Prefect validates a deployment run's parameters against this model before the run starts, and
the nested configs reject unknown keys, so a typo (``--param params='{"lora": {"rnak": 8}}'``)
is refused instead of silently ignored.

    from flows.params import FinetuneParams
    FinetuneParams(preset="tiny", steps=5, lora={"rank": 4})
"""

# No `from __future__ import annotations`: Prefect resolves this model's annotations at run
# time, and postponed annotations make it "not fully defined" in some run paths.

from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from needle.config import EvalConfig, LoraConfig, OptimConfig, TrainConfig, preset_names

CHECKOUT = Path(__file__).resolve().parents[1]
SAMPLE_NEW = "data/sample/new.jsonl"
SAMPLE_BASE = "data/sample/base.jsonl"


class FinetuneParams(BaseModel):
    """Everything one fine-tuning run needs; defaults train on the bundled sample data."""

    model_config = ConfigDict(extra="forbid")

    data: str = Field(SAMPLE_NEW, description="JSONL path, glob or hub id of the rows to fine-tune on")
    base_model: str = Field(
        "auto", description="exported base model directory, or 'auto': train one (mode scratch) on base_data, once"
    )
    base_data: str = Field(SAMPLE_BASE, description="rows for the 'auto' base model")
    base_steps: Optional[int] = Field(None, gt=0, description="optimizer steps of the 'auto' base (None: recipe default)")
    preset: str = Field("small", description="model preset (must match the base model's)")
    mode: Literal["lora", "full"] = Field("lora", description="lora: adapters on a frozen base; full: all weights")
    steps: Optional[int] = Field(None, gt=0, description="fine-tuning steps (None: recipe default for the mode)")
    batch_size: Optional[int] = Field(None, gt=0, description="sequences per step (None: recipe default)")
    seed: int = Field(0, description="seed for init, shuffling and the base model")
    on_error: Literal["fail", "drop"] = Field("fail", description="bad rows: fail with file:line, or drop and report")
    max_len: Optional[int] = Field(None, gt=8, description="longest tokenized row (None: the model's max_len)")
    lora: LoraConfig = Field(default_factory=LoraConfig, description="adapter settings (mode lora)")
    optim: Optional[OptimConfig] = Field(None, description="optimizer settings (None: recipe default for the mode)")
    train: dict[str, Any] = Field(
        default_factory=dict, description="further TrainConfig keys, e.g. log_every, checkpoint_every"
    )
    eval: EvalConfig = Field(default_factory=EvalConfig, description="generation-based evaluation settings")
    register_model: bool = Field(True, description="create a model version in the MLflow registry")

    @field_validator("preset")
    @classmethod
    def _known_preset(cls, value: str) -> str:
        if value not in preset_names():
            raise ValueError(f"unknown preset {value!r}; choose one of {preset_names()}")
        return value

    @model_validator(mode="after")
    def _check_train_overrides(self) -> "FinetuneParams":
        # Build the TrainConfig once here so bad keys fail at submission, not mid-run.
        TrainConfig.model_validate({"mode": self.mode, **self.train_overrides()})
        return self

    def train_overrides(self) -> dict[str, Any]:
        """TrainConfig overrides from the top-level shortcuts and the ``train`` dict."""
        out: dict[str, Any] = {"seed": self.seed, **self.train}
        for key in ("steps", "batch_size"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if "mode" in out:
            raise ValueError("set the mode with the top-level 'mode' parameter, not train.mode")
        return out

    def optim_overrides(self) -> dict[str, Any]:
        """OptimConfig overrides (only keys the caller set, so recipe defaults stay)."""
        return self.optim.model_dump(exclude_unset=True) if self.optim is not None else {}


def resolve_source(source: str) -> str:
    """Absolute path for a relative local source found in the checkout; other sources unchanged.

    The worker runs in the checkout, but the embedded flow may start anywhere; the bundled
    sample paths must work from both.
    """
    p = Path(source)
    if p.is_absolute() or p.exists() or any(ch in source for ch in "*?["):
        return str(p.resolve()) if p.exists() else source
    in_checkout = CHECKOUT / p
    return str(in_checkout) if in_checkout.exists() else source
