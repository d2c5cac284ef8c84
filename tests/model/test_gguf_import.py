"""GGUF in (needle/model/gguf/): tiny models written as GGUF and read back, every tensor type's
plumbing against gguf's own dequantiser, llama.cpp's q/k row order, and bad files exiting 2.

    pytest tests/model/test_gguf_import.py
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from flax import traverse_util

from gguf_helpers import SPM_CHAT, spm_gguf, tiny_hf_model

ARCHS = ["llama", "qwen2", "qwen3", "gemma3_text"]
TEXT = 'Call get_weather for "Paris" at 12:30, then 4.5 km; ünïcode 🎉 <|im_end|>'


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory: pytest.TempPathFactory, sample_data: dict[str, Path]) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf-hf")
    return {arch: tiny_hf_model(root, arch, sample_data["base"]) for arch in ARCHS}


def _flat(params: dict) -> dict:
    return {k: np.asarray(v) for k, v in traverse_util.flatten_dict(params).items()}


@pytest.mark.parametrize("arch", ARCHS)
def test_f32_round_trip_is_exact(arch: str, hf_models: dict[str, Path], tmp_path: Path) -> None:
    from needle.data.chat import with_tool_listing
    from needle.model.gguf.writer import write_gguf
    from needle.model.io import load_model

    hf = load_model(hf_models[arch])
    path = write_gguf(tmp_path / "m.gguf", hf.params, hf.model_cfg, hf.tokenizer, "f32")
    back = load_model(path)
    a, b = _flat(hf.params), _flat(back.params)
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    assert back.model_cfg.model_dump(exclude={"hf_config"}) == hf.model_cfg.model_dump(exclude={"hf_config"})
    assert back.tokenizer.encode(TEXT) == hf.tokenizer.encode(TEXT)
    assert back.tokenizer.decode(back.tokenizer.encode(TEXT)) == TEXT
    # Gemma 3's template gains the tool listing needle trains with (llama.cpp's OpenAI route passes tools)
    assert back.tokenizer.chat_template == with_tool_listing(hf.tokenizer.chat_template)
    assert set(hf.tokenizer.stop_ids) <= set(back.tokenizer.stop_ids)
    assert back.meta["base"]["format"] == "gguf" and back.meta["base"]["arch"] == hf.model_cfg.arch


# Worst error relative to each tensor's largest value: half an f16 / bf16 ulp (2^-11, 2^-8 of the
# value), and for Q8_0 half a step of a block's int8 scale (max|w| / 127 / 2) plus its f16 rounding.
@pytest.mark.parametrize("type_, rel", [("f16", 2**-11), ("bf16", 2**-8), ("q8_0", 1 / 254 + 2**-11)])
def test_lossy_types_read_back_close(type_: str, rel: float, hf_models: dict[str, Path], tmp_path: Path) -> None:
    from needle.model.gguf.reader import read_gguf
    from needle.model.gguf.writer import write_gguf
    from needle.model.io import load_model

    hf = load_model(hf_models["llama"])
    path = write_gguf(tmp_path / "m.gguf", hf.params, hf.model_cfg, hf.tokenizer, type_)
    kinds = {t.type_name for t in read_gguf(path).tensors.values()}
    assert kinds == {"F32", type_.upper()}  # norms stay F32, matrices take the type
    a, b = _flat(hf.params), _flat(load_model(path).params)
    errors = {k: float(np.abs(a[k] - b[k]).max() / np.abs(a[k]).max()) for k in a}
    assert 0 < max(errors.values()) <= rel, max(errors.items(), key=lambda kv: kv[1])


@pytest.mark.parametrize("type_name", ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K",
                                       "Q5_K", "Q6_K"])  # fmt: skip
def test_every_supported_type_reads_as_gguf_dequantises_it(type_name: str, tmp_path: Path) -> None:
    """Raw blocks of each type, written and read back: offsets, shapes and types line up."""
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.constants import GGML_QUANT_SIZES
    from gguf.quants import dequantize

    from needle.model.gguf.reader import read_gguf

    qtype = GGMLQuantizationType[type_name]
    block, size = GGML_QUANT_SIZES[qtype]
    rows, cols = 3, 256  # 256: a whole K-quant super-block per row
    raw = np.random.default_rng(0).integers(0, 256, (rows, cols // block * size), dtype=np.uint8)
    w = GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    w.add_tensor("pad", np.zeros(3, np.float32))  # a first tensor, so the second's offset is not 0
    w.add_tensor("t", raw, raw_dtype=qtype)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    got = read_gguf(tmp_path / "t.gguf").tensor("t")
    assert got.shape == (rows, cols) and got.dtype == np.float32
    np.testing.assert_array_equal(got, dequantize(raw, qtype).astype(np.float32))


def test_llama_q_k_rows_are_llama_cpps_order() -> None:
    """needle writes what llama.cpp's convert_hf_to_gguf.py LlamaModel.permute writes, and undoes it."""
    from needle.config import ModelConfig
    from needle.model.gguf.tensors import _convert

    cfg = ModelConfig(arch="llama", d_model=32, n_heads=4, n_kv_heads=2, vocab_size=64, d_ff=64, n_layers=1)
    q = np.arange(32 * 32, dtype=np.float32).reshape(32, 32)  # HF layout [out, in]

    def permute(w: np.ndarray, n_head: int) -> np.ndarray:  # llama.cpp's, verbatim in numpy
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    written = _convert("blk.0.attn_q.weight", q, cfg, undo=False)
    np.testing.assert_array_equal(written, permute(q, 4))
    np.testing.assert_array_equal(_convert("blk.0.attn_q.weight", written, cfg, undo=True), q)
    k = q[:16]
    np.testing.assert_array_equal(_convert("blk.0.attn_k.weight", k, cfg, undo=False), permute(k, 2))
    assert np.array_equal(_convert("blk.0.attn_v.weight", k, cfg, undo=False), k)  # v untouched


def test_gemma3_norms_are_stored_plus_one(hf_models: dict[str, Path], tmp_path: Path) -> None:
    from needle.model.gguf.reader import read_gguf
    from needle.model.gguf.writer import write_gguf
    from needle.model.io import load_model

    hf = load_model(hf_models["gemma3_text"])
    f = read_gguf(write_gguf(tmp_path / "g.gguf", hf.params, hf.model_cfg, hf.tokenizer, "f32"))
    np.testing.assert_array_equal(f.tensor("output_norm.weight"), np.asarray(hf.params["final_norm"]["scale"]) + 1)
    kinds = f.metadata["gemma3.attention.sliding_window_pattern"]
    assert kinds == [k == "sliding_attention" for k in hf.model_cfg.resolved_layer_types()] and False in kinds


def test_llama3_rope_scaling_travels_as_rope_freqs(hf_models: dict[str, Path], tmp_path: Path) -> None:
    """Llama 3.x files carry their RoPE scaling as llama.cpp's rope_freqs.weight divisors, both ways."""
    from needle.config import RopeScaling
    from needle.model.gguf.reader import read_gguf
    from needle.model.gguf.writer import write_gguf
    from needle.model.io import load_model

    hf = load_model(hf_models["llama"])
    cfg = hf.model_cfg.model_copy(update={"rope_theta": 500000.0, "rope_scaling": RopeScaling(type="llama3", factor=32.0)})
    path = write_gguf(tmp_path / "l3.gguf", hf.params, cfg, hf.tokenizer, "f32")
    divisors = read_gguf(path).tensor("rope_freqs.weight")
    assert divisors.shape == (cfg.head_dim // 2,) and divisors[0] == 1.0 and divisors[-1] == 32.0
    assert load_model(path).model_cfg.rope_scaling == cfg.rope_scaling


@pytest.mark.parametrize("space_prefix", [False, True])
def test_sentencepiece_vocabulary_encodes_as_sentencepiece(space_prefix: bool, tmp_path: Path) -> None:
    """A `llama`-type (SentencePiece) GGUF tokenizer, as Gemma 3's files hold, gives sentencepiece's ids."""
    from needle.model.gguf.reader import read_gguf
    from needle.model.gguf.tokenizer import gguf_tokenizer

    path, sp = spm_gguf(tmp_path / "spm.gguf", space_prefix)
    tok = gguf_tokenizer(read_gguf(path))
    samples = ["Call get_weather for city Paris at 12:30", "  two  spaces\tand a tab; ünïcode 🎉 bytes"]
    if not space_prefix:  # with a prefix, llama.cpp (and HF's legacy mode) prepend it after every special token too
        samples.append(SPM_CHAT)
    for text in samples:
        assert tok.encode(text) == sp.encode(text), text
        assert tok.decode(tok.encode(text)) == text
