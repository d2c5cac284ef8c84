"""The decoder-only Transformer that native, Hugging Face and GGUF models share: ``transformer``
(the Flax module and its cache), ``scan`` (one compiled block over stacked layers), ``layers``,
``attention`` (dense and blocked), ``tiled`` (packed rows in key tiles), ``splash`` and ``flash`` (TPU
kernels), ``recompute`` (rematerialisation)."""
