"""Write (and read back) Needle's on-device ``.cact`` archive with cactus-needle's own code.

Runs ONLY in the cactus-needle side virtualenv (needle/model/needle3/cactus_env.py), as
``python -I cact_worker.py spec.json``: the ``needle`` it imports is cactus-needle, never this
repository, so it imports nothing from here. The spec names a format-2 checkpoint (the merged
fine-tune), the SentencePiece model, the output path and whether to drop the confidence head
(a LoRA fine-tune leaves it untrained, as ``needle build`` does). It writes the archive the way
cactus-needle's ``needle build --lora`` does (``write_export`` with ``WEIGHT_BITS`` and the
effective KV window), reads it back with ``read_export`` and writes a JSON summary to
``spec["summary"]``.
"""

import json
import sys
from types import SimpleNamespace


def main(spec_path):
    spec = json.load(open(spec_path))
    import sentencepiece as spm
    from needle.model.architecture import ConfidenceHead, effective_kv_window
    from needle.model.export import _tokenizer_blob, read_export, write_export
    from needle.model.quantize import WEIGHT_BITS
    from needle.model.run import load_checkpoint

    params, config = load_checkpoint(spec["checkpoint"])
    if spec.get("drop_confidence"):
        params = {k: v for k, v in params.items() if k != ConfidenceHead.key}
    sp = spm.SentencePieceProcessor(model_file=spec["sp_model"])
    blob = _tokenizer_blob(SimpleNamespace(sp=sp))
    info = write_export(params, config, spec["out"], bits=WEIGHT_BITS, tokenizer=blob,
                       kv_window=effective_kv_window(config))
    header, tensors = read_export(spec["out"])
    summary = {"bytes": info["bytes"], "tensors": info["tensors"], "weight_bits": WEIGHT_BITS,
               "read_back": {"num_tensors": header["num_tensors"], "num_layers": header["num_layers"],
                             "d_model": header["d_model"], "vocab_size": header["vocab_size"],
                             "kv_window": header["kv_window"], "tensors_read": len(tensors)}}
    json.dump(summary, open(spec["summary"], "w"))


if __name__ == "__main__":
    main(sys.argv[1])
