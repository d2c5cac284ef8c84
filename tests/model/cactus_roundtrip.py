"""cactus-needle's view of needle's Needle 3 export (runs ONLY in the cactus-needle side venv).

    python -I tests/model/cactus_roundtrip.py spec.json

The spec names the base checkpoint, needle's exported ``checkpoint.safetensors`` and
``adapter.safetensors``, the ``.cact`` archive, token ids and an output ``.npz``. With
cactus-needle's own code (the ``needle`` imported here is cactus-needle, never this repository)
it writes the logits of

- ``merged_plain`` / ``merged_quant``: ``load_checkpoint(export checkpoint)``, plain and deploy numerics;
- ``adapter_plain`` / ``adapter_quant``: ``load_checkpoint(base)`` + ``read_adapter`` + ``merge_lora``;

plus ``adapter_scale`` and ``cact_tensors`` (``read_export`` of the archive).
"""

import json
import sys


def main(spec_path):
    spec = json.load(open(spec_path))
    import jax.numpy as jnp
    import numpy as np
    from needle.model.architecture import SimpleAttentionNetwork
    from needle.model.checkpoints import read_adapter
    from needle.model.export import read_export
    from needle.model.finetune import merge_lora
    from needle.model.quantize import configure_deploy
    from needle.model.run import load_checkpoint

    ids = jnp.asarray(np.asarray(spec["ids"], np.int32))
    out = {}
    params, config = load_checkpoint(spec["checkpoint"])
    configure_deploy(act_bits=config.act_bits, kv_bits=config.kv_bits)
    model = SimpleAttentionNetwork(config)
    for name, quant in (("plain", False), ("quant", True)):
        out[f"merged_{name}"] = np.asarray(model.apply({"params": params}, ids, quant=quant), np.float32)
    base, base_cfg = load_checkpoint(spec["base"])
    adapter = read_adapter(spec["adapter"])
    lora = {tuple(k.split("/")): {"A": jnp.asarray(v["A"]), "B": jnp.asarray(v["B"])} for k, v in adapter["lora"].items()}
    merged = merge_lora(base, lora, adapter["scale"])
    base_model = SimpleAttentionNetwork(base_cfg)
    for name, quant in (("plain", False), ("quant", True)):
        out[f"adapter_{name}"] = np.asarray(base_model.apply({"params": merged}, ids, quant=quant), np.float32)
    out["adapter_scale"] = np.float32(adapter["scale"])
    out["adapter_groups"] = np.int32(len(lora))
    header, tensors = read_export(spec["cact"])
    out["cact_tensors"] = np.int32(len(tensors))
    out["cact_declared"] = np.int32(header["num_tensors"])
    np.savez(spec["out"], **out)


if __name__ == "__main__":
    main(sys.argv[1])
