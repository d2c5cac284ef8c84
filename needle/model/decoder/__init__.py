"""The decoder-only Transformer that native, Hugging Face and GGUF models share: ``transformer``
(the Flax module and its cache), ``scan`` (one compiled block over stacked layers), ``layers``,
``attention`` (dense and blocked), ``splash`` (TPU kernels), ``recompute`` (rematerialisation)."""
