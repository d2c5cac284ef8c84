"""Bad GGUF bases: `needle train --base FILE.gguf` exits 2 naming the file and what is wrong,
before any training (the output directory is never created), never with a traceback.

    pytest tests/model/test_gguf_errors.py
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest


def _write(path: Path, arch: str, tensors: dict[str, tuple[np.ndarray, object]], **meta: object) -> Path:
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), arch)
    for key, value in meta.items():
        w.add_uint32(key, value) if isinstance(value, int) else w.add_string(key, str(value))
    for name, (data, raw) in tensors.items():
        w.add_tensor(name, data, raw_dtype=raw)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return path


@pytest.fixture(scope="module")
def good_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A valid tiny llama GGUF (native tiny preset weights, needle's sample tokenizer)."""
    from needle.config import model_preset
    from needle.model.gguf.writer import write_gguf
    from needle.model.lora import init_params
    from needle.tokenizers.native import train_tokenizer

    tok = train_tokenizer(["call the weather tool for Paris please"] * 4, vocab_size=300)
    cfg = model_preset("tiny").model_copy(update={"vocab_size": 300})
    return write_gguf(tmp_path_factory.mktemp("good") / "tiny.gguf", init_params(cfg, None, 0), cfg, tok, "f32")


def _truncated(good: Path, tmp: Path) -> Path:
    data = good.read_bytes()
    (tmp / "cut.gguf").write_bytes(data[: len(data) // 2])
    return tmp / "cut.gguf"


def _wrong_magic(good: Path, tmp: Path) -> Path:
    (tmp / "model.gguf").write_bytes(b"PK\x03\x04" + good.read_bytes()[4:])
    return tmp / "model.gguf"


def _unknown_arch(good: Path, tmp: Path) -> Path:
    return _write(tmp / "mamba.gguf", "mamba", {"token_embd.weight": (np.zeros((8, 32), np.float32), None)})


def _unsupported_type(good: Path, tmp: Path) -> Path:
    """The good file with its embedding stored as I32, a type needle does not dequantise."""
    from needle.model.gguf.reader import read_gguf

    f = read_gguf(good)
    tensors = {n: (f.tensor(n), None) for n in f.tensors}
    tensors["token_embd.weight"] = (f.tensor("token_embd.weight").astype(np.int32), None)
    meta = {k: v for k, v in f.metadata.items() if k.startswith("llama.") and isinstance(v, int)}
    return _write(tmp / "i32.gguf", "llama", tensors, **meta)


def _adapter(good: Path, tmp: Path) -> Path:
    return _write(tmp / "lora.gguf", "llama", {"blk.0.attn_q.weight.lora_a": (np.zeros((4, 32), np.float32), None)},
                  **{"general.type": "adapter"})  # fmt: skip


CASES: dict[str, tuple[Callable[[Path, Path], Path], str]] = {
    "truncated": (_truncated, "truncated"),
    "wrong magic": (_wrong_magic, "not a GGUF file"),
    "unknown architecture": (_unknown_arch, "general.architecture 'mamba' is not supported"),
    "unsupported tensor type": (_unsupported_type, "unsupported tensor type I32 (token_embd.weight)"),
    "an adapter": (_adapter, "general.type is 'adapter'"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_gguf_base_exits_2_naming_file_and_reason(
    case: str, good_gguf: Path, tmp_path: Path, sample_data: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    from needle.cli import main

    make, reason = CASES[case]
    bad = make(good_gguf, tmp_path)
    out = tmp_path / "run"
    assert main(["train", str(sample_data["new"]), "--base", str(bad), "--out", str(out), "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert f"error: {bad.absolute()}: " in err and reason in err and "Traceback" not in err
    assert not out.exists()


def test_good_gguf_base_loads(good_gguf: Path) -> None:
    from needle.model.io import load_model

    loaded = load_model(good_gguf)
    assert loaded.model_cfg.arch == "llama" and loaded.meta["base"]["file_type"] == "F32"
