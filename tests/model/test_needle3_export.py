"""`needle export --format needle` read back by cactus-needle 3.2.8 itself (its side virtualenv).

A tuned Needle 3 model (random base made by ``needle sample-model --arch needle3``'s writer, plus
a non-zero LoRA adapter) is exported; cactus-needle then loads the merged checkpoint, merges the
exported adapter into the base with its own ``merge_lora`` and reads the ``.cact`` archive back.
Its logits must equal needle's tuned logits in plain and deploy numerics. The side virtualenv is
built with pip on first use (needle/model/needle3/cactus_env.py), so this needs the package registry once.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from needle.config import LoraConfig
from needle.data.sample import generate_rows, write_rows
from needle.model import lora as lora_lib
from needle.model.factory import module_for
from needle.model.io import load_model, save_model
from needle.model.needle3.export import export_needle
from needle.model.needle3.random_model import write_random_needle3

pytestmark = pytest.mark.slow
ROUNDTRIP = Path(__file__).with_name("cactus_roundtrip.py")


@pytest.fixture(scope="module")
def tuned(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("n3export")
    rows = write_rows(root / "rows.jsonl", generate_rows(120, "new", seed=3))
    base_dir = write_random_needle3(root / "base", data=rows, seed=1)
    base = load_model(base_dir)
    lora = LoraConfig(rank=4, alpha=8.0)
    with_lora = module_for(base.model_cfg, lora).init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
    # Non-zero B so the adapter changes the logits; the base weights are the loaded checkpoint's.
    adapter = jax.tree_util.tree_map_with_path(
        lambda p, v: 0.05 * jax.random.normal(jax.random.key(len(p)), v.shape) if p[-1].key == "lora_b" else v,
        with_lora,
    )
    adapter_only, _ = lora_lib.split_trainable(adapter, "lora")
    combined = lora_lib.combine(adapter_only, base.params)
    merged = lora_lib.merge_lora(combined, lora)
    meta = {"lora": lora.model_dump(mode="json"), "base": base.meta["base"], "seed": 0, "steps": 3}
    model_dir = save_model(root / "tuned", merged, base.model_cfg, base.tokenizer, meta, adapter=adapter_only)
    out = export_needle(model_dir, root / "export")
    return {"root": root, "base": base_dir, "model": model_dir, **out}


def test_export_writes_needle_files(tuned: dict[str, Path]) -> None:
    for name in ("checkpoint.safetensors", "adapter.safetensors", "model.cact", "tokenizer.model"):
        assert tuned[name].is_file() and tuned[name].stat().st_size > 0, name
    summary = json.loads((tuned["root"] / "export" / "cact.json").read_text())
    assert summary["read_back"]["tensors_read"] == summary["read_back"]["num_tensors"] == summary["tensors"]


def test_cactus_needle_reads_the_export_and_computes_needles_logits(tuned: dict[str, Path]) -> None:
    from needle.model.needle3.cactus_env import run_in_cactus_env

    loaded = load_model(tuned["model"])
    ids = np.asarray([loaded.tokenizer.encode("<|im_start|>user\nsend a text to Bo<|im_end|>\n<tool_call>[")], np.int32)
    spec = {"checkpoint": str(tuned["checkpoint.safetensors"]), "adapter": str(tuned["adapter.safetensors"]),
            "base": str(tuned["base"] / "checkpoints" / "needle3.safetensors"), "cact": str(tuned["model.cact"]),
            "ids": ids.tolist(), "out": str(tuned["root"] / "cactus.npz")}  # fmt: skip
    spec_path = tuned["root"] / "roundtrip.json"
    spec_path.write_text(json.dumps(spec))
    run_in_cactus_env(ROUNDTRIP, [str(spec_path)])
    ref = np.load(spec["out"])
    model = module_for(loaded.model_cfg)
    for name, quant in (("plain", False), ("quant", True)):
        ours = np.asarray(model.apply({"params": loaded.params}, jnp.asarray(ids), quant=quant))
        np.testing.assert_allclose(ours, ref[f"merged_{name}"], atol=1e-4, rtol=0, err_msg=f"checkpoint, {name}")
        np.testing.assert_allclose(ours, ref[f"adapter_{name}"], atol=1e-4, rtol=0, err_msg=f"base + adapter, {name}")
    base = load_model(tuned["base"])
    base_logits = np.asarray(module_for(base.model_cfg).apply({"params": base.params}, jnp.asarray(ids)))
    assert np.abs(base_logits - ref["merged_plain"]).max() > 1e-3, "the adapter changed nothing: the test would not see a lost adapter"
    assert float(ref["adapter_scale"]) == pytest.approx(2.0)
    assert int(ref["cact_tensors"]) == int(ref["cact_declared"]) > 0


def test_export_refuses_a_model_of_another_family(tmp_path: Path) -> None:
    from needle.errors import ModelImportError
    from needle.model.hf.random_model import write_random_hf_model

    hf_dir = write_random_hf_model(tmp_path / "qwen", "qwen3", vocab_size=512)
    with pytest.raises(ModelImportError, match="Needle 3 models only"):
        export_needle(hf_dir, tmp_path / "out", archive=False)
    assert not (tmp_path / "out").exists()
