"""GGUF, llama.cpp's model file: read one as a needle base, write a needle model (and its LoRA) as one.

In: ``load_model("model.gguf")`` (so ``--base model.gguf`` everywhere) goes through
:func:`needle.model.gguf.importer.import_gguf_model`: ``reader`` parses the file, ``config`` maps
its metadata to a ``ModelConfig``, ``tensors`` dequantises and re-lays the weights, ``tokenizer``
rebuilds the tokenizer and chat template. Out: ``needle export MODEL OUT --format gguf`` is
:func:`needle.model.gguf.export.export_gguf`, written by ``writer``.

    needle finetune data/sample/new.jsonl --base SmolLM2-135M-Instruct.Q4_1.gguf
    needle export runs/tuned/model out/gguf --format gguf --type q8_0
    pytest tests/model/test_gguf_import.py tests/model/test_gguf_export.py tests/model/test_gguf_errors.py
    pytest -m gguf tests/model/test_gguf_llama_cpp.py     # against llama.cpp (llama-cpp-python)
"""
