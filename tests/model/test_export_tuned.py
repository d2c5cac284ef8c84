"""`needle export` of a model fine-tuned on an imported base: the HF export and the PEFT adapter
reproduce needle's logits in transformers / peft (torch tier), and bad requests exit 2."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

IDS = np.array([[5, 17, 99, 300, 42, 7, 8, 250, 11, 3]], np.int32)


@pytest.fixture(scope="module")
def tuned_qwen3(tmp_path_factory: pytest.TempPathFactory, sample_data: dict[str, Path]) -> dict[str, Path]:
    """A tiny random Qwen3, LoRA-tuned for two steps with `needle train` (the library path)."""
    from needle.cli import main
    from needle.model.hf.random_model import write_random_hf_model

    root = tmp_path_factory.mktemp("export")
    base = write_random_hf_model(root / "base", "qwen3", data=sample_data["base"], vocab_size=512, d_model=32)
    assert main([
        "train", str(sample_data["new"]), "--base", str(base), "--out", str(root / "run"), "--steps", "2",
        "--batch-size", "4", "--max-len", "1024",
    ]) == 0  # fmt: skip
    return {"base": base, "model": root / "run" / "model", "root": root}


def _needle_logits(model_dir: Path) -> np.ndarray:
    import jax.numpy as jnp

    from needle.model.io import load_model
    from needle.model.decoder.transformer import Transformer

    m = load_model(model_dir)
    return np.asarray(Transformer(m.model_cfg).apply({"params": m.params}, jnp.asarray(IDS)))


@pytest.mark.torch
def test_hf_and_peft_exports_reproduce_needle_logits(tuned_qwen3: dict[str, Path]) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from needle.cli import main

    hf_dir, peft_dir = tuned_qwen3["root"] / "hf", tuned_qwen3["root"] / "peft"
    assert main(["export", str(tuned_qwen3["model"]), str(hf_dir), "--format", "hf"]) == 0
    assert main(["export", str(tuned_qwen3["model"]), str(peft_dir), "--format", "peft"]) == 0
    ours = _needle_logits(tuned_qwen3["model"])
    ids = torch.tensor(IDS, dtype=torch.long)
    merged = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    np.testing.assert_allclose(merged(ids).logits.detach().numpy(), ours, atol=1e-4)
    base = transformers.AutoModelForCausalLM.from_pretrained(tuned_qwen3["base"], dtype=torch.float32).eval()
    untouched = base(ids).logits.detach().numpy()  # before peft injects the adapter into `base`
    adapted = peft.PeftModel.from_pretrained(base, peft_dir).eval()
    np.testing.assert_allclose(adapted(ids).logits.detach().numpy(), ours, atol=1e-4)
    assert np.abs(untouched - ours).max() > 1e-3  # the adapter is not a no-op


def test_export_without_an_adapter_or_a_model_exits_2(tuned_qwen3: dict[str, Path], tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    from needle.cli import main

    assert main(["export", str(tuned_qwen3["base"]), str(tmp_path / "p"), "--format", "peft"]) == 2
    assert "not a LoRA fine-tune" in capsys.readouterr().err
    assert main(["export", str(tmp_path), str(tmp_path / "h"), "--format", "hf"]) == 2
    assert not (tmp_path / "h").exists() and not (tmp_path / "p").exists()


def test_untouched_import_exports_the_original_weights(tuned_qwen3: dict[str, Path], tmp_path: Path) -> None:
    from safetensors.numpy import load_file

    from needle.cli import main

    assert main(["export", str(tuned_qwen3["base"]), str(tmp_path / "hf"), "--format", "hf"]) == 0
    before, after = load_file(tuned_qwen3["base"] / "model.safetensors"), load_file(tmp_path / "hf" / "model.safetensors")
    assert before.keys() == after.keys()
    assert all(np.array_equal(before[k], after[k]) and before[k].dtype == after[k].dtype for k in before)
