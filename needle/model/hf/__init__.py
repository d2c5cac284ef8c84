"""Hugging Face models: ``config`` (config.json to ``ModelConfig``, hub snapshots), ``weights``
(safetensors in), ``export`` (Hugging Face and PEFT out) and ``sample`` (small random models)."""
