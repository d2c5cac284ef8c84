"""Hugging Face models: ``config`` (config.json to ``ModelConfig``, hub snapshots), ``weights``
(safetensors in), ``importer`` (``import_hf_model``), ``export`` (Hugging Face and PEFT out) and
``random_model`` (small random models for tests and benchmarks)."""
