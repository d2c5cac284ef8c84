"""One place that builds the Flax module of any model family from its ``ModelConfig``.

Everything that applies a model (training, evaluation, decoding, serving, export) calls
:func:`module_for`, so nothing above ``needle/model`` asks which family a model is. Native and
Hugging Face families share ``Transformer``; Needle 3 (``arch="needle3"``) has its own module
in ``needle/model/needle3``. Every module maps int32 ids ``[B, T]`` to float32 logits
``[B, T, V]`` with ``apply({"params": p}, ids)`` and follows ``Transformer``'s cache contract.

    from needle.model.factory import module_for
    logits = module_for(loaded.model_cfg).apply({"params": loaded.params}, ids)
"""

from __future__ import annotations

from typing import Any

from needle.config import LoraConfig, ModelConfig
from needle.hardware import BackendSettings


def module_for(cfg: ModelConfig, lora: LoraConfig | None = None, settings: BackendSettings | None = None) -> Any:
    """The Flax module of ``cfg``'s family, with LoRA adapters when ``lora`` is given."""
    if cfg.arch == "needle3":
        from needle.model.needle3.architecture import Needle3Model

        return Needle3Model(cfg, lora, settings)
    from needle.model.transformer import Transformer

    return Transformer(cfg, lora, settings)
