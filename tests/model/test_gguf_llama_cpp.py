"""needle's GGUF files against llama.cpp itself (llama-cpp-python): the `gguf` test tier.

    pip install -e '.[gguf]'       # builds llama.cpp from source: about 12.5 CPU-minutes
    pytest -m gguf tests/model/test_gguf_llama_cpp.py

llama.cpp runs with an F32 KV cache: its default F16 cache rounds every key and value, which
alone moves SmolLM2's logits by up to 0.016. Tolerances, each with its reason:

- F32 files: the same float32 arithmetic in another order, logits within 1e-3 (measured: 7e-5 on
  SmolLM2-135M, 30 layers); Gemma 3 within 5e-3, as llama.cpp's CPU GELU is a float16 lookup
  table (measured 1.8e-3 on the tiny model).
- F16 / BF16 files: llama.cpp's CPU kernels round the activations to the weights' type before
  each matrix product: logits within 0.05 (f16) and 0.5 (bf16); greedy tokens equal on SmolLM2
  (a real model) and, on the tiny random tuned model, wherever needle's two best logits are not a
  near-tie within that tolerance.
- SmolLM2's own Q4_1 file: llama.cpp also rounds activations to 8 bits (Q8_1 blocks) for Q4_1
  products, which needle (float32 activations on the dequantised weights) does not. needle's
  import is checked exactly through its F32 re-export (above); on the Q4_1 file itself the two
  differ by that rounding alone, bounded here as measured (max 2.6, mean 0.23 over 37 positions).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gguf_helpers import SPM_CHAT, greedy, logits, sample_prompts, smollm2_or_skip, spm_gguf, tiny_hf_model, tuned_llama

pytestmark = pytest.mark.gguf
llama_cpp = pytest.importorskip("llama_cpp", reason="the gguf tier needs llama-cpp-python: pip install -e '.[gguf]'")
F32 = 0  # GGML_TYPE_F32, for the KV cache


def _llama(path: Path, lora: Path | None = None) -> Any:
    extra = {"lora_path": str(lora)} if lora else {}
    return llama_cpp.Llama(model_path=str(path), n_ctx=4096, logits_all=True, verbose=False, n_threads=2,
                           type_k=F32, type_v=F32, **extra)  # fmt: skip


def _llama_logits(llm: Any, ids: list[int]) -> np.ndarray:
    llm.reset()
    llm.eval(ids)
    return np.array(llm.scores[: len(ids)])


def _llama_greedy(llm: Any, ids: list[int], n: int, stops: tuple[int, ...]) -> list[int]:
    llm.reset()
    llm.eval(ids)
    out: list[int] = []
    while len(out) < n:
        nxt = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        if nxt in stops:
            break
        out.append(nxt)
        llm.eval([nxt])
    return out


@pytest.fixture(scope="module")
def tuned(tmp_path_factory: pytest.TempPathFactory, sample_data: dict[str, Path]) -> dict[str, Path]:
    return tuned_llama(tmp_path_factory.mktemp("gguf-llama-cpp"), sample_data["new"])


@pytest.mark.parametrize("arch", ["llama", "llama3-scaled", "qwen2", "qwen3", "gemma3_text"])
def test_f32_export_gives_needles_logits_in_llama_cpp(arch: str, tmp_path: Path, sample_data: dict[str, Path]) -> None:
    from needle.config import RopeScaling
    from needle.model.gguf.writer import write_gguf
    from needle.model.io import load_model

    m = load_model(tiny_hf_model(tmp_path, arch.removesuffix("3-scaled"), sample_data["base"]))
    if arch == "llama3-scaled":  # Llama 3.x RoPE scaling: llama.cpp reads it from rope_freqs.weight
        llama3 = {"rope_theta": 500000.0, "rope_scaling": RopeScaling(type="llama3", factor=32.0)}
        m = m.__class__(m.params, m.model_cfg.model_copy(update=llama3), m.tokenizer, m.meta)
    path = write_gguf(tmp_path / "m.gguf", m.params, m.model_cfg, m.tokenizer, "f32")
    ids = sample_prompts(m.tokenizer, sample_data["new"], 1, limit=3500)[0]
    atol = 5e-3 if arch == "gemma3_text" else 1e-3  # module doc: llama.cpp's float16 GELU table
    np.testing.assert_allclose(_llama_logits(_llama(path), ids), logits(m, ids), atol=atol)


def _same_greedy(llm: Any, m: Any, ids: list[int], atol: float, n: int = 24) -> None:
    """llama.cpp's greedy tokens are needle's, except where needle's two best logits are within the
    logit tolerance of each other (a near-tie the type's rounding may break either way): there the
    tokens may part, and the check stops."""
    ours, theirs = greedy(m, ids, n), _llama_greedy(llm, ids, n, m.tokenizer.stop_ids)
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            row = logits(m, ids + ours[:i])[-1]
            assert row[a] - row[b] <= 2 * atol, f"token {i}: {a} vs {b}, margin {row[a] - row[b]:.4f}"
            return
    assert len(ours) == len(theirs)


@pytest.mark.parametrize("type_, atol", [("f32", 1e-3), ("f16", 0.05), ("bf16", 0.5)])
def test_tuned_export_greedy_tokens_equal_needles(type_: str, atol: float, tuned: dict[str, Path],
                                                  sample_data: dict[str, Path]) -> None:  # fmt: skip
    from needle.cli import main
    from needle.model.io import load_model

    out = tuned["root"] / f"gguf-{type_}"
    assert main(["export", str(tuned["model"]), str(out), "--format", "gguf", "--type", type_]) == 0
    m = load_model(tuned["model"])
    llm = _llama(out / "model.gguf")
    for ids in sample_prompts(m.tokenizer, sample_data["new"]):
        np.testing.assert_allclose(_llama_logits(llm, ids), logits(m, ids), atol=atol)
        if type_ == "f32":  # the same arithmetic: the same tokens, near-ties included
            assert _llama_greedy(llm, ids, 24, m.tokenizer.stop_ids) == greedy(m, ids, 24)
        else:
            _same_greedy(llm, m, ids, atol)


def test_lora_adapter_on_the_base_gives_the_merged_models_tokens(tuned: dict[str, Path],
                                                                  sample_data: dict[str, Path]) -> None:  # fmt: skip
    from needle.cli import main
    from needle.model.io import load_model

    out = tuned["root"] / "gguf-lora"
    assert main(["export", str(tuned["model"]), str(out), "--format", "gguf", "--type", "f32"]) == 0
    assert main(["export", str(tuned["base"]), str(tuned["root"] / "base.gguf"), "--format", "gguf", "--type", "f32"]) == 0
    m = load_model(tuned["model"])
    with_adapter = _llama(tuned["root"] / "base.gguf", lora=out / "adapter.gguf")
    base_only = _llama(tuned["root"] / "base.gguf")
    ids = sample_prompts(m.tokenizer, sample_data["new"], 1)[0]
    adapted = _llama_logits(with_adapter, ids)
    np.testing.assert_allclose(adapted, logits(m, ids), atol=1e-3)
    assert np.abs(_llama_logits(base_only, ids) - adapted).max() > 1e-3  # the adapter is not a no-op
    assert _llama_greedy(with_adapter, ids, 24, m.tokenizer.stop_ids) == greedy(m, ids, 24)


@pytest.mark.parametrize("space_prefix", [False, True])
def test_sentencepiece_vocabulary_ids_are_llama_cpps(space_prefix: bool, tmp_path: Path) -> None:
    """Gemma 3's tokenizer type, with and without llama.cpp's space prefix (after special tokens too)."""
    from needle.model.gguf.reader import read_gguf
    from needle.model.gguf.tokenizer import gguf_tokenizer

    path, _ = spm_gguf(tmp_path / "spm.gguf", space_prefix)
    tok = gguf_tokenizer(read_gguf(path))
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    for text in ["Call get_weather for city Paris at 12:30", "  two  spaces\tand a tab; ünïcode 🎉 bytes", SPM_CHAT]:
        assert tok.encode(text) == llm.tokenize(text.encode(), add_bos=False, special=True), text


@pytest.fixture(scope="module")
def smollm2() -> Any:
    return smollm2_or_skip()


def test_smollm2_tokenizer_ids_are_llama_cpps(smollm2: tuple[Path, Any]) -> None:
    path, m = smollm2
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=256, verbose=False, vocab_only=True)
    texts = ["What is the capital of France?", "<|im_start|>user\nCall get_weather(\"Paris\", 12.5)<|im_end|>\n",
             "  leading spaces, tabs\tand 12345 digits; ünïcode 🎉 'quotes' don't"]  # fmt: skip
    for text in texts:
        assert m.tokenizer.encode(text) == llm.tokenize(text.encode(), add_bos=False, special=True)


def test_smollm2_import_matches_llama_cpp(smollm2: tuple[Path, Any], tmp_path: Path) -> None:
    from needle.model.gguf.writer import write_gguf

    path, m = smollm2
    text = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    ids = m.tokenizer.encode(text)
    ours = logits(m, ids)
    # needle's dequantised weights, written back as F32: llama.cpp's forward on them is needle's.
    exact = write_gguf(tmp_path / "smollm2-f32.gguf", m.params, m.model_cfg, m.tokenizer, "f32")
    np.testing.assert_allclose(_llama_logits(_llama(exact), ids), ours, atol=1e-3)
    # The Q4_1 file itself: the gap is llama.cpp's 8-bit activation rounding (module doc).
    gap = np.abs(_llama_logits(_llama(path), ids) - ours)
    assert gap.max() < 4.0 and gap.mean() < 0.4


def test_smollm2_f16_export_greedy_equals_needles(smollm2: tuple[Path, Any], tmp_path: Path,
                                                  sample_data: dict[str, Path]) -> None:  # fmt: skip
    """A real model's logits are decisive: every greedy token equal, on chat and tool-calling prompts."""
    from needle.model.gguf.writer import write_gguf

    from needle.data.chat import compile_template

    _, m = smollm2
    llm = _llama(write_gguf(tmp_path / "smollm2-f16.gguf", m.params, m.model_cfg, m.tokenizer, "f16"))
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = m.tokenizer.encode(compile_template(m.tokenizer.chat_template).render(messages=messages, add_generation_prompt=True))
    for ids in [chat, *sample_prompts(m.tokenizer, sample_data["new"], 1)]:
        assert _llama_greedy(llm, ids, 16, m.tokenizer.stop_ids) == greedy(m, ids, 16)
    # llama.cpp's own chat path: the file's chat template, its stop tokens, needle's answer.
    reply = llm.create_chat_completion(messages=messages, temperature=0.0, max_tokens=16)["choices"][0]
    assert reply["message"]["content"] == m.tokenizer.decode(greedy(m, chat, 16)) and reply["finish_reason"] == "stop"


def test_llama_cpps_chat_handler_shows_openai_tools_as_needle_trained(sample_data: dict[str, Path]) -> None:
    """The exported template (with_tool_listing) in llama-cpp-python's own Jinja chat handler, as its
    OpenAI server calls it with a request's messages and tools: needle's training prompt, for a
    template that shows no tools itself (Gemma 3's, SmolLM2's)."""
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    from needle.data.chat import JinjaChatFormat, with_tool_listing
    from needle.data.load import load_source
    from needle.model.hf.random_model import family_template

    specials = {"bos_token": "<bos>", "eos_token": "<eos>"}
    ours = JinjaChatFormat(family_template("gemma3"), specials)
    assert not ours.renders_tools
    handler = Jinja2ChatFormatter(with_tool_listing(ours.template), **specials)
    for row in load_source(str(sample_data["new"]), "fail").rows[:20]:
        request = {"messages": [{"role": "user", "content": row.query}],
                   "tools": [{"type": "function", "function": t} for t in row.tools]}  # fmt: skip
        assert handler(**request).prompt == ours.render_prompt(row)
