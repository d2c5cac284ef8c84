"""Needle 3 (cactus-needle 3.2.8's ``SimpleAttentionNetwork``) inside needle.

Ported from cactus-needle 3.2.8 (Apache-2.0). ``architecture.Needle3Model`` is the Flax module
(reference parameter tree, needle's call/cache/packing/LoRA contracts, reference logits in plain
and ``quant=True`` numerics); ``checkpoint`` reads and writes the reference's format-version-2
``.safetensors`` checkpoints; ``quantize`` holds the reference's fake quantisers (QAT).
Submodules are imported lazily by their users (``needle.model.factory.module_for``).
"""
