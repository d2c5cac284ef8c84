"""`needle export --format gguf` of a LoRA-tuned model: the model file reads back as the tuned
model, the adapter file is llama.cpp's LoRA format and folds into the base to give the merged
weights, and `needle predict` takes the exported file (llama.cpp itself: test_gguf_llama_cpp.py).

    pytest tests/model/test_gguf_export.py
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from gguf_helpers import logits, sample_prompts, tuned_llama


@pytest.fixture(scope="module")
def tuned(tmp_path_factory: pytest.TempPathFactory, sample_data: dict[str, Path]) -> dict[str, Path]:
    return tuned_llama(tmp_path_factory.mktemp("gguf-export"), sample_data["new"])


@pytest.fixture(scope="module")
def exported(tuned: dict[str, Path]) -> Path:
    from needle.cli import main

    assert main(["export", str(tuned["model"]), str(tuned["root"] / "gguf"), "--format", "gguf", "--type", "f32"]) == 0
    return tuned["root"] / "gguf"


def test_model_file_reads_back_as_the_tuned_model(tuned: dict[str, Path], exported: Path,
                                                  sample_data: dict[str, Path]) -> None:  # fmt: skip
    from needle.model.io import load_model

    ours, back = load_model(tuned["model"]), load_model(exported / "model.gguf")
    ids = sample_prompts(ours.tokenizer, sample_data["new"], 1)[0][:200]
    np.testing.assert_array_equal(logits(back, ids), logits(ours, ids))  # f32: the same weights, bit for bit
    assert back.tokenizer.encode("get_weather Paris") == ours.tokenizer.encode("get_weather Paris")
    assert back.tokenizer.chat_template == ours.tokenizer.chat_template


def test_adapter_file_is_llama_cpps_lora_and_folds_into_the_base(tuned: dict[str, Path], exported: Path) -> None:
    from needle.config import LoraConfig
    from needle.model.gguf.reader import read_gguf
    from needle.model.gguf.writer import write_gguf
    from needle.model.io import load_model

    adapter = read_gguf(exported / "adapter.gguf")
    lora = LoraConfig.model_validate(json.loads((tuned["model"] / "meta.json").read_text())["lora"])
    assert adapter.metadata["general.type"] == "adapter" and adapter.metadata["adapter.type"] == "lora"
    assert adapter.metadata["general.architecture"] == "llama"
    assert adapter.metadata["adapter.lora.alpha"] == pytest.approx(lora.alpha)
    base = load_model(tuned["base"])
    base_file = read_gguf(write_gguf(tuned["root"] / "base.gguf", base.params, base.model_cfg, base.tokenizer, "f32"))
    merged = read_gguf(exported / "model.gguf")
    names = sorted(n.removesuffix(".lora_a") for n in adapter.tensors if n.endswith(".lora_a"))
    assert "blk.0.attn_q.weight" in names and "blk.1.ffn_down.weight" in names
    for name in names:  # llama.cpp's LoRA: W + alpha / r * B @ A, in its own (permuted) layout
        a, b = adapter.tensor(f"{name}.lora_a"), adapter.tensor(f"{name}.lora_b")
        assert a.shape[0] == b.shape[1] == lora.rank
        folded = base_file.tensor(name) + lora.alpha / lora.rank * (b @ a)
        np.testing.assert_allclose(folded, merged.tensor(name), atol=1e-5)


def test_out_as_a_file_name_and_bad_requests(tuned: dict[str, Path], tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    from needle.cli import main
    from needle.model.gguf.reader import read_gguf

    assert main(["export", str(tuned["model"]), str(tmp_path / "tuned.gguf"), "--format", "gguf", "--type", "q8_0"]) == 0
    assert capsys.readouterr().out.split() == [str(tmp_path / "tuned.gguf"), str(tmp_path / "tuned.lora.gguf")]
    assert read_gguf(tmp_path / "tuned.gguf").metadata["general.file_type"] == 7  # MOSTLY_Q8_0
    assert main(["export", str(tuned["model"]), str(tmp_path / "hf"), "--format", "hf", "--type", "f16"]) == 2
    assert "--type applies to --format gguf only" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "nothing"), str(tmp_path / "x.gguf"), "--format", "gguf"]) == 2
    assert not (tmp_path / "hf").exists() and not (tmp_path / "x.gguf").exists()


def test_predict_takes_the_exported_file(exported: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from needle.cli import main

    tools = [{"name": "get_weather", "description": "weather of a city",
              "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
    (tmp_path / "tools.json").write_text(json.dumps(tools))
    code = main(["predict", str(exported / "model.gguf"), "--tools", str(tmp_path / "tools.json"), "--query", "Paris?"])
    calls = json.loads(capsys.readouterr().out.splitlines()[0])  # constrained: only the offered tool
    assert code == 0 and isinstance(calls, list) and {c["name"] for c in calls} <= {"get_weather"}


def test_training_on_a_gguf_base_exports_gguf_again(exported: Path, tmp_path: Path, sample_data: dict[str, Path]) -> None:
    """`needle train --base FILE.gguf` trains, and the run's exports (as the flow logs them) include GGUF."""
    from needle.cli import main
    from needle.model.export import export_run_model
    from needle.model.io import load_model

    base = exported / "model.gguf"
    assert main(["train", str(sample_data["new"]), "--base", str(base), "--out", str(tmp_path / "run"), "--steps", "1",
                 "--batch-size", "4", "--max-len", "2048", "--on-error", "drop"]) == 0  # fmt: skip
    tuned = tmp_path / "run" / "model"
    assert load_model(tuned).meta["base"]["source"] == str(base.absolute())
    paths = export_run_model(tuned, tmp_path / "exports")
    assert set(paths) == {"hf", "peft", "gguf"}
    assert sorted(p.name for p in paths["gguf"].iterdir()) == ["adapter.gguf", "model.gguf"]


def test_serve_wraps_a_gguf_file_once(exported: Path, tmp_path: Path) -> None:
    """What `needle serve FILE.gguf` serves: the import saved once per file content, then reused."""
    from needle.model.io import gguf_model_dir
    from needle.model.io import load_model

    first = gguf_model_dir(exported / "model.gguf", tmp_path)
    stamp = (first / "config.json").stat().st_mtime_ns
    assert gguf_model_dir(exported / "model.gguf", tmp_path) == first and (first / "config.json").stat().st_mtime_ns == stamp
    assert load_model(first).meta["base"]["format"] == "gguf"
