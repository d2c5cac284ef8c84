"""needle vs transformers/peft, live (torch tier): logits, greedy decoding, HF export, PEFT adapters.

Tiny float32 models of each family are built offline (make_hf_fixtures.build_model) and saved
with ``save_pretrained``. Skipped cleanly without torch; run with
``pip install torch==2.13.0 transformers peft`` (the ``ref`` extra) and
``pytest -m torch tests/model``.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util
from make_hf_fixtures import EXTRA_SPECS, N_NEW, SPECS, build_model, reference_greedy, reference_logits, tokens_and_lengths

from needle.config import LoraConfig, model_preset
from needle.eval.decode import generate
from needle.model.hf.config import hf_config_to_model_config
from needle.model.hf.export import export_hf, export_peft
from needle.model.hf.weights import load_hf_params
from needle.model.lora import attach_base, init_params, merge_lora
from needle.model.decoder.transformer import Transformer

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytestmark = pytest.mark.torch
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _real(logits: np.ndarray, lengths: list[int]) -> np.ndarray:
    return np.concatenate([logits[row, :n] for row, n in enumerate(lengths)])


def _hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


@pytest.mark.parametrize("name", sorted(SPECS) + sorted(EXTRA_SPECS))
def test_logits_and_greedy_equal_transformers(name, tmp_path, logits_of):
    ref_model = build_model(name, tmp_path)
    tokens, lengths = tokens_and_lengths(seed=1)
    want = _real(reference_logits(ref_model, tokens, lengths), lengths)
    cfg = hf_config_to_model_config(tmp_path)
    params = load_hf_params(tmp_path, cfg)
    model = Transformer(cfg)
    got = _real(np.asarray(logits_of(model, params, jnp.asarray(tokens))), lengths)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    prompts = [tokens[row, :n].tolist() for row, n in enumerate(lengths)]
    ours = generate(model, params, prompts, max_new_tokens=N_NEW, end_id=-1, pad_id=0, batch_size=2)
    assert ours == reference_greedy(ref_model, prompts)


def _random_adapters(cfg, lora, base, seed: int = 0) -> dict:
    """LoRA params on ``base`` with nonzero lora_b, so the adapters change the output."""
    flat = traverse_util.flatten_dict(attach_base(init_params(cfg, lora, seed), base))
    rng = np.random.default_rng(seed)
    flat = {k: (jnp.asarray(rng.normal(0, 0.2, v.shape), jnp.float32) if k[-1] == "lora_b" else v) for k, v in flat.items()}
    return traverse_util.unflatten_dict(flat)


@pytest.mark.parametrize("name", ["llama", "qwen2", "gemma3_text"])
def test_merged_hf_export_and_peft_adapter_load(name, tmp_path, logits_of):
    from peft import PeftModel

    build_model(name, tmp_path / "base")
    cfg = hf_config_to_model_config(tmp_path / "base")
    base = load_hf_params(tmp_path / "base", cfg)
    lora = LoraConfig(rank=4, alpha=8.0)
    params = _random_adapters(cfg, lora, base)
    merged = merge_lora(params, lora)
    tokens, lengths = tokens_and_lengths(seed=2)
    ours = _real(np.asarray(logits_of(Transformer(cfg), merged, jnp.asarray(tokens))), lengths)

    exported = _hf_model(export_hf(merged, cfg, None, tmp_path / "merged"))
    np.testing.assert_allclose(_real(reference_logits(exported, tokens, lengths), lengths), ours, atol=1e-4, rtol=0)

    adapter = export_peft(params, lora, {"source": str(tmp_path / "base")}, tmp_path / "adapter")
    peft_model = PeftModel.from_pretrained(_hf_model(tmp_path / "base"), adapter).eval()
    np.testing.assert_allclose(_real(reference_logits(peft_model, tokens, lengths), lengths), ours, atol=1e-4, rtol=0)


def test_native_model_exports_as_equivalent_llama(tmp_path, logits_of):
    cfg = model_preset("tiny", vocab_size=384)
    params = jax.tree.map(lambda x: x * 2.0, init_params(cfg, None, 0))  # logits far from uniform
    tokens, lengths = tokens_and_lengths(seed=3)
    ours = _real(np.asarray(logits_of(Transformer(cfg), params, jnp.asarray(tokens))), lengths)
    theirs = _hf_model(export_hf(params, cfg, None, tmp_path / "hf"))
    assert type(theirs).__name__ == "LlamaForCausalLM"
    np.testing.assert_allclose(_real(reference_logits(theirs, tokens, lengths), lengths), ours, atol=1e-4, rtol=0)
