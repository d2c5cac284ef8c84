"""What a ``ModelConfig`` builds: the Flax module of its family, its abstract params, and
``LoadedModel``, a model read back from any source.

Everything that applies a model (training, evaluation, decoding, serving, export) calls
:func:`module_for`, so nothing above ``needle/model`` asks which family a model is. Native and
Hugging Face families share ``Transformer``; Needle 3 (``arch="needle3"``) has its own module
in ``needle/model/needle3``. Every module maps int32 ids ``[B, T]`` to float32 logits
``[B, T, V]`` with ``apply({"params": p}, ids)`` and follows ``Transformer``'s cache contract.
Every family's importer (needle/model/io.py, hf/, needle3/, gguf/) returns a :class:`LoadedModel`.

    from needle.model.factory import module_for
    logits = module_for(loaded.model_cfg).apply({"params": loaded.params}, ids)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from needle.config import LoraConfig, ModelConfig
from needle.hardware import BackendSettings
from needle.model.needle3.architecture import Needle3Model
from needle.model.decoder.transformer import Transformer


def module_for(cfg: ModelConfig, lora: LoraConfig | None = None, settings: BackendSettings | None = None) -> Any:
    """The Flax module of ``cfg``'s family, with LoRA adapters when ``lora`` is given."""
    if cfg.arch == "needle3":
        return Needle3Model(cfg, lora, settings)
    return Transformer(cfg, lora, settings)


def abstract_params(cfg: ModelConfig) -> dict[str, Any]:
    """Shapes and dtypes of a LoRA-free model's params, without computing any."""
    model = module_for(cfg)
    tokens = jnp.zeros((1, 1), jnp.int32)
    return jax.eval_shape(lambda: model.init(jax.random.key(0), tokens)["params"])


@dataclass(frozen=True)
class LoadedModel:
    """A model read back (an exported directory or an imported base): params (jax arrays), its
    config, tokenizer and metadata."""

    params: dict[str, Any]
    model_cfg: ModelConfig
    tokenizer: Any
    meta: dict[str, Any]
